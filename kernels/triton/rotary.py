"""Rotary position embedding, NeoX/Llama halves layout, applied to q and k in one launch."""

import torch
import triton
import triton.language as tl

from kvrelay.kernels import kv_quant
from kvrelay.kernels.triton.utils import pow2
from kvrelay.kernels.triton.write_kv import fp8_store_scales, scale_arg, to_cache


@triton.jit
def _rotated(
    x_ptr, t, cos, sin, partner_d, sign, rot_mask, stride_xt, stride_xh, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # [BLOCK_H, BLOCK_D]: out[d] = x[d]*cos[d%half] + sign*x[partner(d)]*sin[d%half] for d < rot_dim, x[d] beyond
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    row = x_ptr + t * stride_xt + h[:, None] * stride_xh
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xp = tl.load(row + partner_d[None, :], mask=mask & rot_mask[None, :], other=0.0).to(tl.float32)
    rotated = x.to(tl.float32) * cos[None, :] + sign[None, :] * xp * sin[None, :]
    return tl.where(rot_mask[None, :], rotated.to(x.dtype), x)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, t, cos, sin, partner_d, sign, rot_mask,
    stride_xt, stride_xh, stride_ot, stride_oh, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    y = _rotated(x_ptr, t, cos, sin, partner_d, sign, rot_mask, stride_xt, stride_xh, num_heads, head_dim,
                 BLOCK_H, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], y, mask=mask)


@triton.jit
def _cos_sin(cache_ptr, pos_ptr, t, stride_cache, half, BLOCK_D: tl.constexpr):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rot_mask = d < 2 * half
    first = d < half
    idx = tl.where(first, d, d - half)
    partner_d = tl.where(first, d + half, d - half)
    sign = tl.where(first, -1.0, 1.0)
    cs_row = cache_ptr + pos * stride_cache
    cos = tl.load(cs_row + idx, mask=rot_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + half + idx, mask=rot_mask, other=0.0).to(tl.float32)
    return cos, sin, partner_d, sign, rot_mask


@triton.jit
def _rotary_kernel(
    pos_ptr, cache_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
    stride_cache, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    num_q_heads, num_k_heads, head_dim, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: cos/sin are read once and shared by all q and k heads
    t = tl.program_id(0).to(tl.int64)
    cos, sin, partner_d, sign, rot_mask = _cos_sin(cache_ptr, pos_ptr, t, stride_cache, half, BLOCK_D)
    _rotate_heads(q_ptr, q_out_ptr, t, cos, sin, partner_d, sign, rot_mask,
                  stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads, head_dim, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, t, cos, sin, partner_d, sign, rot_mask,
                  stride_kt, stride_kh, stride_kot, stride_koh, num_k_heads, head_dim, BLOCK_HK, BLOCK_D)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]; cos_sin_cache: [max_pos, rot_dim] = cat(cos, sin)
    # returns new (q, k); the inputs are left untouched, as the reference does
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens:
        bd = pow2(head_dim)
        _rotary_kernel[(num_tokens,)](
            positions, cache, q, k, q_out, k_out,
            cache.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            num_q_heads, num_k_heads, head_dim, rot_dim // 2,
            BLOCK_HQ=pow2(num_q_heads), BLOCK_HK=pow2(num_k_heads), BLOCK_D=bd,
            num_warps=min(8, max(1, pow2(num_q_heads) * bd // 512)),
        )
    return q_out, k_out


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr, cs_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, scale_ptr,
    stride_cs, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_ckv, stride_cb, stride_ct, stride_ch,
    num_q_heads, num_k_heads, head_dim, half,
    PAGE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    # one program per token: rotate its q heads (-> q_out) and k heads (-> k_out and the cache), copy
    # its v heads into the cache; the slot's block and offset go through the cache's real strides. An fp8
    # cache stores k / K scale and v / V scale (write_kv.py's to_cache)
    t = tl.program_id(0).to(tl.int64)
    cos, sin, partner_d, sign, rot_mask = _cos_sin(cs_ptr, pos_ptr, t, stride_cs, half, BLOCK_D)
    _rotate_heads(q_ptr, q_out_ptr, t, cos, sin, partner_d, sign, rot_mask,
                  stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads, head_dim, BLOCK_HQ, BLOCK_D)
    k = _rotated(k_ptr, t, cos, sin, partner_d, sign, rot_mask, stride_kt, stride_kh, num_k_heads, head_dim,
                 BLOCK_HK, BLOCK_D)
    h = tl.arange(0, BLOCK_HK)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_k_heads) & (d[None, :] < head_dim)
    tl.store(k_out_ptr + t * stride_kot + h[:, None] * stride_koh + d[None, :], k, mask=mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # the slot check is broadcast through an index tensor: the interpreter rejects scalar-bool masks
    c_mask = mask & ((h[:, None] * 0 + slot) >= 0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=c_mask)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + h[:, None] * stride_ch + d[None, :]
    k_scale, v_scale = fp8_store_scales(scale_ptr, FP8)
    tl.store(dst, to_cache(k, k_scale, cache_ptr.dtype.element_ty, FP8), mask=c_mask)
    tl.store(dst + stride_ckv, to_cache(v, v_scale, cache_ptr.dtype.element_ty, FP8), mask=c_mask)


def rotary_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # rotary_embedding + write_kv in one launch (kv_scale: float32 [2] (K, V) of an fp8 cache). q: [T, H, D]; k, v: [T, Hkv, D] (any token/head strides);
    # kv_cache: [2, N, bs, Hkv, D] with any strides (unit in D); slot -1 = not stored. Returns rotated (q, k).
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    page = kv_cache.shape[2]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim and kv_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens:
        bd = pow2(head_dim)
        _rotary_write_kv_kernel[(num_tokens,)](
            positions, cache, q, k, v, q_out, k_out, kv_cache, slot_mapping, scale_arg(kv_cache, kv_scale, q),
            cache.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            num_q_heads, num_k_heads, head_dim, rot_dim // 2,
            PAGE=page, BLOCK_HQ=pow2(num_q_heads), BLOCK_HK=pow2(num_k_heads), BLOCK_D=bd,
            FP8=kv_quant.is_fp8(kv_cache),
            num_warps=min(8, max(1, pow2(num_q_heads) * bd // 512)),
        )
    return q_out, k_out
