"""Paged decode attention (one query token per sequence) with GQA and split-K ("flash-decoding").

Grid: (sequence, kv head, split). One program loads the K/V of its kv head once and serves all
``group = H / Hkv`` query heads of it: the group rows are packed into the M dimension of a tensor-core
dot (padded to 16 rows, which costs nothing in a kernel bound by reading the cache). Long contexts are
cut into ``num_splits`` contiguous token ranges so that even a batch of one fills the GPU; each split
writes an unnormalised partial output plus its running max and sum, and a second kernel merges them.

The split count depends only on host-known numbers (batch, heads, ``meta.max_seq_len``) and each
program derives its token range from its own sequence's length on the device, so the launch is
CUDA-graph capturable: capture with ``max_seq_len`` set to the largest length the graph will see.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.triton.utils import interpreting, num_sms, pow2

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # tokens per inner-loop tile
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
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_ptr,
    out_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
    scale_log2, num_splits,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    num_heads, group, head_dim,
    PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
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
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634

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
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
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
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    # q: [S, H, D] (one token per sequence); kv_cache: [2, N, bs, Hkv, D] -> out [S, H, D]
    num_seqs, num_heads, head_dim = q.shape
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
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
    interp = interpreting()
    bd = pow2(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
        alibi_slopes if alibi_slopes is not None else q,
        out, part_o, part_m, part_l,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        num_heads, group, head_dim,
        PAGE=page, BLOCK_G=pow2(group, 16), BLOCK_D=bd, BLOCK_N=block_n,
        SPLIT=split, HAS_ALIBI=alibi_slopes is not None,
        UPCAST=interp, IEEE=q.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if split:
        _merge_kernel[(num_seqs, num_heads)](
            part_o, part_m, part_l, out, num_splits, num_heads, head_dim, out.stride(0), out.stride(1),
            BLOCK_SPLITS=pow2(num_splits), BLOCK_D=bd, num_warps=1 if interp else 4,
        )
    return out
