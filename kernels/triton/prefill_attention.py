"""Prefill / chunked-prefill attention over the paged KV cache, varlen queries, causal with a prefix.

Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``: the last ``q_len`` tokens
of its ``seq_len`` keys, so query ``j`` sees keys ``0 .. seq_len - q_len + j``. Everything, cached
prefix and this step's tokens alike, is read from the cache (write_kv runs first).

Grid: (query tile, kv head). A tile packs ``tokens_per_tile`` consecutive query tokens times the
``group`` query heads of one kv head into the M rows of the dot, so K/V tiles are loaded once per
kv head rather than once per query head (the GQA layout of vLLM's unified Triton attention). Tiles
map to sequences on the device: sequence ``i`` owns tile slots ``qsl[i] // tpt + i`` onwards, which
gives every sequence at least ``cdiv(q_len, tpt)`` slots in a grid of ``T // tpt + S`` programs, and a
program finds its sequence by binary search and exits if its slot is spare. No host sync is needed.
"""

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.triton.decode_attention import _dot
from kernels.triton.utils import interpreting, pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, alibi_ptr, out_ptr,
    scale_log2, num_seqs, tokens_per_tile,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    group, head_dim,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # largest sequence i whose first tile slot qsl[i] // tpt + i is <= tile
    lo = tile * 0  # i32 scalars, not constexprs: they are loop-carried
    hi = tile * 0 + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid) // tokens_per_tile + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    t0 = (tile - (q_start // tokens_per_tile + seq)) * tokens_per_tile
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys already cached before this step's tokens

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = t0 + r // group  # [BLOCK_M] query token (within the sequence) of each row
    heads = kvh * group + r % group
    row_mask = (r < tokens_per_tile * group) & (tok < q_len)
    d_mask = d < head_dim
    qo_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    q_pos = context + tok  # absolute position; every row may at least see key 0, so no row is all -inf
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    kv_end = context + tl.minimum(t0 + tokens_per_tile, q_len)  # causal: the tile's last query sees this far
    for n0 in range(0, kv_end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < kv_end
        block = tl.load(table + offs // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_rows = block * stride_cb + (offs % PAGE) * stride_ct + head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), UPCAST, IEEE) * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        if HAS_ALIBI:
            s += slope[:, None] * offs[None, :].to(tl.float32)
        s = tl.where((offs[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new

    out = acc / l_i[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    # q: [T, H, D] packed varlen queries; kv_cache: [2, N, bs, Hkv, D] -> out [T, H, D]
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert kv_cache.stride(-1) == 1 and page & (page - 1) == 0
    interp = interpreting()
    bd = pow2(head_dim, 16)
    if block_m is None:
        # 128 rows amortise each K/V tile over more queries; short batches keep 64 for more programs
        block_m = 128 if meta.max_query_len * group >= 512 and bd <= 128 and not interp else 64
    block_m = max(block_m, pow2(group, 16))
    tokens_per_tile = block_m // group
    grid = (num_tokens // tokens_per_tile + meta.num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
        alibi_slopes if alibi_slopes is not None else q, out,
        scale * _LOG2E, meta.num_seqs, tokens_per_tile,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        group, head_dim,
        PAGE=page, BLOCK_M=block_m, BLOCK_D=bd, BLOCK_N=64 if bd <= 128 else 32,
        HAS_ALIBI=alibi_slopes is not None, UPCAST=interp, IEEE=q.dtype == torch.float32,
        num_warps=8 if block_m >= 128 else 4, num_stages=2,
    )
    return out
