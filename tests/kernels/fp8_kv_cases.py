"""Checks of the Triton kernels on an fp8 (e4m3) KV cache, shared by the interpreter tests and the GPU
tests: each kernel takes the float8 cache and its per-layer scales directly and must match a torch
reference that dequantizes the cache first (``stored.float() * scale``) and attends in float32.

Scales other than 1 (K 0.5, V 2.0 by default) so a kernel that ignores one, or applies it the wrong way
round, fails; the stored bytes are compared exactly against kernels/reference.py's write."""

from importlib import import_module

import torch

from kvrelay.kernels import reference
from tests.kernels.triton_cases import assert_close, fresh_kv, make_paged_case

FP8 = torch.float8_e4m3fn
SCALES = (0.5, 2.0)


def kv_scale(device: str, scales: tuple[float, float] = SCALES) -> torch.Tensor:
    return torch.tensor(scales, dtype=torch.float32, device=device)


def fp8_cache_like(kv_cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``kv_cache``'s values stored as fp8 under ``scale`` (K then V), in a cache of the same strided
    layout: one layer of a block-major pool."""
    n, page, hkv, d = kv_cache.shape[1:]
    pool = torch.empty(n, 2, 2, page, hkv, d, dtype=FP8, device=kv_cache.device)
    out = pool[:, 1].permute(1, 0, 2, 3, 4)  # [2, N, bs, Hkv, D], strided like make_paged_case's
    for i in range(2):
        out[i] = (kv_cache[i].float() / scale[i]).clamp(-448, 448).to(FP8)
    return out


def dequantized(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference's view of an fp8 cache: float32 values, dequantized before any attention runs."""
    return torch.stack([cache[0].float() * scale[0], cache[1].float() * scale[1]])


def check_write_kv(tk, device: str, num_tokens: int, num_kv_heads: int, head_dim: int, page: int,
                   dtype: torch.dtype) -> None:
    num_blocks = -(-num_tokens // page) + 2
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    slots = slots.to(device)
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 20).to(dtype).to(device)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 300).to(dtype).to(device)
    k[0, 0, :2] = torch.tensor([1e4, -1e4], dtype=dtype)  # past 448 * K scale: clamped, never inf/NaN
    scale = kv_scale(device)
    cache = torch.zeros(2, num_blocks, page, num_kv_heads, head_dim, dtype=FP8, device=device)
    expected = cache.clone()
    tk.write_kv(k, v, cache, slots, scale)
    reference.write_kv(k, v, expected, slots, scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    keep = slots >= 0
    blocks, offs = slots[keep] // page, slots[keep] % page
    got_k = cache[0, blocks, offs].float() * scale[0]
    got_v = cache[1, blocks, offs].float() * scale[1]
    want_k = k[keep].float().clamp(-448 * SCALES[0], 448 * SCALES[0])
    want_v = v[keep].float().clamp(-448 * SCALES[1], 448 * SCALES[1])
    # e4m3 keeps 3 mantissa bits: within 1/16 relative, plus the subnormal step (2^-9) times the scale
    assert torch.all((got_k - want_k).abs() <= want_k.abs() / 16 + 2 ** -9 * SCALES[0])
    assert torch.all((got_v - want_v).abs() <= want_v.abs() / 16 + 2 ** -9 * SCALES[1])
    assert torch.isfinite(cache.float()).all()


def check_rotary_write_kv(tk, device: str, tokens: int, heads: int, kv_heads: int, head_dim: int, page: int,
                          dtype: torch.dtype) -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    gen = torch.Generator().manual_seed(tokens + heads)
    num_blocks = -(-tokens // page) + 2
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens].to(device)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(device)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype).to(device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    scale = kv_scale(device)
    cache = torch.zeros(2, num_blocks, page, kv_heads, head_dim, dtype=FP8, device=device)
    expected = cache.clone()
    got_q, got_k = tk.rotary_write_kv(positions, q, k, v, cs, cache, slots, scale)
    want_q, want_k = reference.rotary_write_kv(positions, q, k, v, cs, expected, slots, scale)
    assert_close(got_k, want_k, dtype, scale=0.5)
    # the stored bytes: the kernel's own rotated k and the plain v, each quantized under its scale
    blocks, offs = slots // page, slots % page
    assert torch.equal(cache[0, blocks, offs].view(torch.uint8),
                       (got_k.float() / scale[0]).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert torch.equal(cache[1].view(torch.uint8), expected[1].view(torch.uint8))


def check_paged_attention(tk, device: str, q_lens: list[int], seq_lens: list[int], num_heads: int,
                          num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                          num_splits: int | None = None, seed: int = 0, configs: tuple = ()) -> None:
    """Decode (split or not) and prefill/mixed batches over an fp8 cache, with the step's own k/v passed
    too (as the models pass them): the kernels must still attend over the stored, rounded values.
    ``configs``: explicit prefill tilings, each checked as well."""
    q, bf_cache, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, page, dtype, device, seed)
    scale = kv_scale(device)
    cache = fp8_cache_like(bf_cache * 3, scale)
    sm_scale = head_dim ** -0.5
    expected = reference.paged_attention(q.float(), dequantized(cache, scale), meta, sm_scale)
    if num_splits is not None:
        decode = import_module("kvrelay.kernels.triton.decode_attention").decode_attention
        out = decode(q, cache, meta, sm_scale, num_splits=num_splits, kv_scale=scale)
    else:
        out = tk.paged_attention(q, cache, meta, sm_scale, kv_scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, expected, dtype)
    if not meta.decode_only:
        k, v = fresh_kv(bf_cache * 3, meta)  # unrounded: the kernel must not prefer them to the cache
        assert_close(tk.paged_attention(q, cache, meta, sm_scale, k=k, v=v, kv_scale=scale), expected, dtype)
    for config in configs:
        prefill = import_module("kvrelay.kernels.triton.prefill_attention").prefill_attention
        assert_close(prefill(q, cache, meta, sm_scale, config=config, kv_scale=scale), expected, dtype)
    # the reference path the CPU engine runs agrees with the same dequantize-first reference
    assert_close(reference.paged_attention(q.float(), cache, meta, sm_scale, kv_scale=scale), expected, torch.float32)


def check_rotary_decode_attention(tk, device: str, seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                                  page: int, dtype: torch.dtype, num_splits: int | None = None) -> None:
    """Rotary + fp8 KV write + decode attention in one kernel against the reference's rotary and write,
    then attention over the dequantized cache."""
    _, bf_cache, meta = make_paged_case([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, page, dtype,
                                        device, seed=len(seq_lens))
    scale = kv_scale(device)
    cache = fp8_cache_like(bf_cache, scale)
    gen = torch.Generator().manual_seed(3)
    n = len(seq_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max(seq_lens), dtype=torch.float32)[:, None] * inv_freq[None, :]  # every position
    cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    positions = meta.seq_lens.long() - 1
    expected_cache = cache.clone()
    want_q, _ = reference.rotary_write_kv(positions, q, k, v, cs, expected_cache, meta.slot_mapping, scale)
    fused = import_module("kvrelay.kernels.triton.decode_attention").rotary_decode_attention
    out = fused(positions, q, k, v, cs, cache, meta, head_dim ** -0.5, num_splits=num_splits, kv_scale=scale)
    # one rounding step of e4m3 apart at most: the kernel's rotation may round k differently in its last bit
    assert_close(dequantized(cache, scale), dequantized(expected_cache, scale), torch.bfloat16, scale=4)
    expected = reference.paged_attention(want_q.float(), dequantized(cache, scale), meta, head_dim ** -0.5)
    assert_close(out, expected, dtype)
