"""Paged decode attention (one query token per sequence) with GQA and split-K ("flash-decoding").

Grid: (sequence, kv head, split). One program loads the K/V of its kv head once and serves all
``group = H / Hkv`` query heads of it: the group rows are packed into the M dimension of a tensor-core
dot (padded to 16 rows, which costs nothing in a kernel bound by reading the cache). Long contexts are
cut into ``num_splits`` contiguous token ranges so that even a batch of one fills the GPU; each split
writes an unnormalised partial output plus its running max and sum, and a second kernel merges them.

The split count depends only on host-known numbers (batch, heads, ``meta.max_seq_len``) and each
program derives its token range from its own sequence's length on the device, so the launch is
CUDA-graph capturable: capture with ``max_seq_len`` set to the largest length the graph will see.

An fp8 cache (kernels/kv_quant.py) is read as it is stored: each K/V tile is loaded as float8 and
converted in registers (exact: every e4m3 value is a bf16/fp16/fp32 value); the K scale is folded into
the softmax scale and the V scale into the output, both per layer, so the inner loop gains no multiply.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.triton.rotary import _cos_sin
from kvrelay.kernels.triton.utils import interpreting, num_sms, pow2
from kvrelay.kernels.triton.write_kv import fp8_store_scales, from_cache, scale_arg, to_cache

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # tokens per inner-loop tile
# fp32 (correctness runs): an IEEE dot's compile time grows with the tile (bench/triton_fp32_compile.py: on the
# H200, 2.1 s for 16 against 3.0 for 64, and no slower to run)
FP32_BLOCK_N = 16
FP32_BLOCK_N_CANDIDATES = (64, 32)  # what the bench times beside it; the interpret tests check each
NUM_WARPS = 4
NUM_STAGES = 3
MIN_TOKENS_PER_SPLIT = 128  # below this a split's merge traffic outweighs the parallelism it adds
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        acc = tl.dot(a, b, input_precision="ieee")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _store_new_kv(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, scale_ptr, seq, kvh, cos, sin, partner_d, sign, rot_mask,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, head_dim,
    PAGE: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    # the step's token of one kv head: k rotated (rounded to k's dtype first, as rotary_write_kv does) and v,
    # stored at the token's slot; slot -1 (a padding row of a captured graph) stores nothing
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    mask = (d < head_dim) & ((d * 0 + slot) >= 0)  # broadcast: the interpreter rejects scalar-bool masks
    k_row = k_ptr + seq.to(tl.int64) * stride_kt + kvh * stride_kh
    k = tl.load(k_row + d, mask=mask, other=0.0)
    kp = tl.load(k_row + partner_d, mask=mask & rot_mask, other=0.0).to(tl.float32)
    k = tl.where(rot_mask, (k.to(tl.float32) * cos + sign * kp * sin).to(k.dtype), k)
    v = tl.load(v_ptr + seq.to(tl.int64) * stride_vt + kvh * stride_vh + d, mask=mask, other=0.0)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + kvh.to(tl.int64) * stride_ch + d
    k_scale, v_scale = fp8_store_scales(scale_ptr, FP8)
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, k_cache_ptr.dtype.element_ty, FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr.dtype.element_ty, FP8), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_ptr,
    out_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
    pos_ptr, cs_ptr, k_ptr, v_ptr, slot_ptr, kv_scale_ptr,
    scale_log2, num_splits,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    stride_cs, stride_kt, stride_kh, stride_vt, stride_vh,
    num_heads, group, head_dim, half,
    PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ROPE: tl.constexpr, FP8: tl.constexpr,
):
    # ROPE: q and the step's k arrive unrotated, and the step's k and v are not yet in the cache. Each
    # program rotates its q rows as it loads them; the program whose token range holds the step's token
    # rotates that k, stores it and v at the token's slot, then reads them back through the cache like
    # any other token. This is rotary_write_kv's work without its launch: a decode step's layer runs one
    # kernel fewer (a batch-1 step launches ~8 a layer, each paying a launch and ramp).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # this split's token range, a multiple of BLOCK_N so only the sequence's last tile is ragged
    chunk = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_dim
    heads = kvh * group + g
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q_rows = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=qo_mask, other=0.0)
    if ROPE:
        cos, sin, partner_d, sign, rot_mask = _cos_sin(cs_ptr, pos_ptr, seq, stride_cs, half, BLOCK_D)
        qp = tl.load(q_rows + partner_d[None, :], mask=qo_mask & rot_mask[None, :], other=0.0).to(tl.float32)
        rotated = q.to(tl.float32) * cos[None, :] + sign[None, :] * qp * sin[None, :]
        q = tl.where(rot_mask[None, :], rotated.to(q.dtype), q)
        if (seq_len - 1 >= start) & (seq_len - 1 < end):
            _store_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr, seq, kvh, cos, sin,
                          partner_d, sign, rot_mask, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb,
                          stride_ct, stride_ch, head_dim, PAGE, BLOCK_D, FP8)
            tl.debug_barrier()  # the stores are visible to this program's threads before the loop reads them
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    if FP8:  # q . (stored * k_scale) = (q . stored) * k_scale: the K scale joins the softmax scale
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        block = tl.load(table + offs // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_cb + (offs % PAGE) * stride_ct + head_off  # [BLOCK_N] token offsets
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = from_cache(tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        v = from_cache(tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        s = _dot(q, tl.trans(k), UPCAST, IEEE) * scale_log2  # [BLOCK_G, BLOCK_N], log2 domain
        if HAS_ALIBI:
            s += slope[:, None] * offs[None, :].to(tl.float32)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new
    if FP8:  # sum p * (stored * v_scale) = (sum p * stored) * v_scale
        acc = acc * tl.load(kv_scale_ptr + 1)

    if SPLIT:
        # partials are [S, H, splits, D]; an empty split leaves m=-inf, l=0, acc=0 and weighs nothing
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_o_ptr + part[:, None] * head_dim + d[None, :], acc, mask=qo_mask)
    else:
        out = acc / l_i[:, None]
        dst = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit
def _merge_kernel(
    part_o_ptr, part_m_ptr, part_l_ptr, out_ptr,
    num_splits, num_heads, head_dim, stride_os, stride_oh,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (sequence, query head): rescale each split to the global max and normalise
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    sp_mask = sp < num_splits
    d_mask = d < head_dim
    base = (seq * num_heads + head) * num_splits
    m = tl.load(part_m_ptr + base + sp, mask=sp_mask, other=float("-inf"))
    denom = tl.load(part_l_ptr + base + sp, mask=sp_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # split 0 always holds a token, so the max is finite
    o = tl.load(part_o_ptr + (base + sp)[:, None] * head_dim + d[None, :], mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w * denom, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Power of two (bounded set of compiled merge variants) giving ~4 programs per SM when possible.

    With >= 2 programs per SM already, splitting only adds merge traffic; a batch of one at a long
    context needs many splits to fill the SMs (`bench/kernels_bench.py --sweep`; H200 numbers in
    BENCHMARKS.md).
    """
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms(device):
        return 1
    want = triton.cdiv(4 * num_sms(device), programs)
    cap = min(MAX_SPLITS, max(1, max_seq_len // MIN_TOKENS_PER_SPLIT))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    return splits


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [S, H, D] (one token per sequence); kv_cache: [2, N, bs, Hkv, D] -> out [S, H, D];
    # kv_scale: float32 [2] (K, V) of an fp8 cache
    return _attend(q, kv_cache, meta, scale, alibi_slopes, num_splits, block_n, None, kv_scale)


def rotary_decode_attention(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, num_splits: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    # rotary_write_kv then decode_attention, in one launch. positions: [S]; q: [S, H, D] and k, v:
    # [S, Hkv, D], unrotated, any token/head strides; cos_sin_cache: [max_pos, rot_dim] -> out [S, H, D]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= q.shape[-1]
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    return _attend(q, kv_cache, meta, scale, None, num_splits, None, (positions, cache, k, v), kv_scale)


def _attend(q, kv_cache, meta, scale, alibi_slopes, num_splits, block_n, rope, kv_scale=None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert kv_cache.stride(-1) == 1 and page & (page - 1) == 0
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, meta.max_seq_len, q.device)
    split = num_splits > 1
    if split:
        part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused: the single-split kernel normalises and writes `out`
    positions, cs, k, v = rope if rope is not None else (meta.seq_lens, q, q, q)  # unused without ROPE
    if block_n is None:
        block_n = FP32_BLOCK_N if q.dtype == torch.float32 else BLOCK_N
    interp = interpreting()
    bd = pow2(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
        alibi_slopes if alibi_slopes is not None else q,
        out, part_o, part_m, part_l,
        positions, cs, k, v, meta.slot_mapping, scale_arg(kv_cache, kv_scale, q),
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        cs.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, group, head_dim, cs.shape[-1] // 2,
        PAGE=page, BLOCK_G=pow2(group, 16), BLOCK_D=bd, BLOCK_N=block_n,
        SPLIT=split, HAS_ALIBI=alibi_slopes is not None,
        UPCAST=interp, IEEE=q.dtype == torch.float32, ROPE=rope is not None, FP8=kv_quant.is_fp8(kv_cache),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if split:
        _merge_kernel[(num_seqs, num_heads)](
            part_o, part_m, part_l, out, num_splits, num_heads, head_dim, out.stride(0), out.stride(1),
            BLOCK_SPLITS=pow2(num_splits), BLOCK_D=bd, num_warps=1 if interp else 4,
        )
    return out
