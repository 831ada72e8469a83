"""Prefill / chunked-prefill attention over the paged KV cache, varlen queries, causal with a prefix.

Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``: the last ``q_len`` tokens
of its ``seq_len`` keys, so query ``j`` sees keys ``0 .. seq_len - q_len + j``. Keys split in two:
the cached *prefix* ``0 .. context-1`` (``context = seq_len - q_len``), which every query row sees in
full, and this step's *fresh* keys, which are plain causal self-attention over the step's tokens.
The prefix is always read through the block table; the fresh keys are read from the step's own
contiguous K/V (``k``/``v`` arguments, as write_kv received them) when the caller passes them, and
from the cache otherwise (write_kv runs first either way, so both hold the same values).

Grid: (query tile, kv head). A tile packs ``tokens_per_tile`` consecutive query tokens times the
``group`` query heads of one kv head into the M rows of the dot, so K/V tiles are loaded once per
kv head rather than once per query head (the GQA layout of vLLM's unified Triton attention). Tiles
map to sequences on the device: sequence ``i`` owns tile slots ``qsl[i] // tpt + i`` onwards, which
gives every sequence at least ``cdiv(q_len, tpt)`` slots in a grid of ``T // tpt + S`` programs, and a
program finds its sequence by binary search and exits if its slot is spare. No host sync is needed.
Programs take slots from the last one down, so the longest (latest) tiles start first and the short
ones fill the tail. Only the key tiles that cross a boundary (the prefix's ragged end, the causal
diagonal) pay for masks; every other tile runs unmasked.

An fp8 cache (kernels/kv_quant.py) is read as float8 tiles converted in registers, with the K scale in
the softmax scale and the V scale on the output (as decode_attention.py); its fresh keys are read from
the cache too, so every query sees the stored (rounded) values that later steps will read.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.triton.decode_attention import _dot
from kvrelay.kernels.triton.utils import interpreting, pow2
from kvrelay.kernels.triton.write_kv import from_cache, scale_arg

_LOG2E = 1.4426950408889634


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _step(q, k, v, acc, m_i, l_i, scale_log2, key_pos, q_key_limit, slope,
          MASK: tl.constexpr, HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # one key tile of the online softmax, in the log2 domain. MASK: key_pos[n] <= q_key_limit[m] decides
    # visibility (the causal diagonal and the prefix's ragged end); unmasked tiles skip the select.
    s = _dot(q, tl.trans(k), UPCAST, IEEE)  # [BLOCK_M, BLOCK_N]
    if HAS_ALIBI or MASK:
        s = s * scale_log2
        if HAS_ALIBI:
            s += slope[:, None] * key_pos[None, :].to(tl.float32)
        if MASK:
            s = tl.where(key_pos[None, :] <= q_key_limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
    return acc, m_new, l_i


@triton.jit
def _fresh_src(j, j_mask, cache_ptr, k_ptr, v_ptr, table, q_start, context, kvh, head_off, d,
               stride_ckv, stride_cb, stride_ct, stride_kt, stride_kh, stride_vt, stride_vh,
               PAGE: tl.constexpr, FRESH: tl.constexpr):
    # [BLOCK_N, BLOCK_D] pointers to this step's keys/values j: the step's own K/V rows, or the cache
    if FRESH:
        f_rows = (q_start + j).to(tl.int64)
        k_src = k_ptr + f_rows[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        v_src = v_ptr + f_rows[:, None] * stride_vt + kvh * stride_vh + d[None, :]
    else:
        pos = context + j
        block = tl.load(table + pos // PAGE, mask=j_mask, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % PAGE) * stride_ct + head_off
        k_src = cache_ptr + rows[:, None] + d[None, :]
        v_src = cache_ptr + stride_ckv + rows[:, None] + d[None, :]
    return k_src, v_src


# the sequence and tile counts only steer the prologue's search for a tile's sequence: specialising on
# them (Triton: == 1, multiple of 16) bought nothing but a compile of a new variant whenever a step's
# counts fell in a new class while serving, which a warm-up before /ready cannot cover by shapes alone
@triton.jit(do_not_specialize=["num_seqs", "num_tiles"])
def _prefill_kernel(
    q_ptr, cache_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, alibi_ptr, out_ptr, kv_scale_ptr,
    scale_log2, num_seqs, tokens_per_tile, num_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ckv, stride_cb, stride_ct, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh,
    group, head_dim,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FRESH: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
):
    tile = num_tiles - 1 - tl.program_id(0)  # the last (longest) tiles first
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
    tok = t0 + r // group  # [BLOCK_M] query token (within the step) of each row
    heads = kvh * group + r % group
    row_mask = (r < tokens_per_tile * group) & (tok < q_len)
    if EVEN_D:
        d_mask = d < BLOCK_D
    else:
        d_mask = d < head_dim
    qo_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    if FP8:  # q . (stored * k_scale) = (q . stored) * k_scale
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    n = tl.arange(0, BLOCK_N)
    all_see = tok * 0 + 2147483647  # a key limit every row passes (prefix tiles are seen in full)

    # 1. the cached prefix: every row sees all of it; only its ragged last tile is masked
    full_end = context // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        offs = n0 + n
        block = tl.load(table + offs // PAGE).to(tl.int64)
        rows = block * stride_cb + (offs % PAGE) * stride_ct + head_off
        k = from_cache(tl.load(cache_ptr + rows[:, None] + d[None, :], mask=d_mask[None, :], other=0.0), q.dtype)
        v = from_cache(tl.load(cache_ptr + stride_ckv + rows[:, None] + d[None, :], mask=d_mask[None, :], other=0.0), q.dtype)
        acc, m_i, l_i = _step(q, k, v, acc, m_i, l_i, scale_log2, offs, all_see, slope,
                              False, HAS_ALIBI, UPCAST, IEEE)
    if full_end < context:
        offs = full_end + n
        n_mask = offs < context
        block = tl.load(table + offs // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_cb + (offs % PAGE) * stride_ct + head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = from_cache(tl.load(cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        v = from_cache(tl.load(cache_ptr + stride_ckv + rows[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        limit = tok * 0 + context - 1
        acc, m_i, l_i = _step(q, k, v, acc, m_i, l_i, scale_log2, offs, limit, slope,
                              True, HAS_ALIBI, UPCAST, IEEE)

    # 2. this step's keys, causal: key j (step-relative) is seen by rows with tok >= j. Tiles wholly
    # below the tile's first token are unmasked; the rest (the diagonal) are masked.
    fresh_end = tl.minimum(t0 + tokens_per_tile, q_len)
    diag_start = (t0 + 1) // BLOCK_N * BLOCK_N  # <= t0 + 1 <= fresh_end
    for j0 in range(0, diag_start, BLOCK_N):
        j = j0 + n
        k_src, v_src = _fresh_src(j, j >= 0, cache_ptr, k_ptr, v_ptr, table, q_start, context, kvh, head_off, d,
                                  stride_ckv, stride_cb, stride_ct, stride_kt, stride_kh, stride_vt, stride_vh,
                                  PAGE, FRESH)
        k = from_cache(tl.load(k_src, mask=d_mask[None, :], other=0.0), q.dtype)
        v = from_cache(tl.load(v_src, mask=d_mask[None, :], other=0.0), q.dtype)
        acc, m_i, l_i = _step(q, k, v, acc, m_i, l_i, scale_log2, context + j, all_see, slope,
                              False, HAS_ALIBI, UPCAST, IEEE)
    for j0 in range(diag_start, fresh_end, BLOCK_N):
        j = j0 + n
        j_mask = j < fresh_end
        k_src, v_src = _fresh_src(j, j_mask, cache_ptr, k_ptr, v_ptr, table, q_start, context, kvh, head_off, d,
                                  stride_ckv, stride_cb, stride_ct, stride_kt, stride_kh, stride_vt, stride_vh,
                                  PAGE, FRESH)
        kv_mask = j_mask[:, None] & d_mask[None, :]
        k = from_cache(tl.load(k_src, mask=kv_mask, other=0.0), q.dtype)
        v = from_cache(tl.load(v_src, mask=kv_mask, other=0.0), q.dtype)
        acc, m_i, l_i = _step(q, k, v, acc, m_i, l_i, scale_log2, context + j, context + tok, slope,
                              True, HAS_ALIBI, UPCAST, IEEE)

    if FP8:  # sum p * (stored * v_scale) = (sum p * stored) * v_scale
        acc = acc * tl.load(kv_scale_ptr + 1)
    out = acc / l_i[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


# (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for long prompts with head_dim <= 128, chosen with
# `bench/kernels_bench.py --prefill` on an H200 (BENCHMARKS.md, "Prefill attention rework"): wide key
# tiles when the cached prefix dominates, narrower ones when the causal diagonal does.
LONG_CONFIG = (128, 64, 8, 3)
PREFIX_CONFIG = (128, 128, 8, 3)
SHORT_CONFIG = (64, 64, 4, 2)
# fp32 is for correctness runs, where only the result and the compile time count: an IEEE fp32 dot is compiled
# to unrolled FMAs, so compile time grows with the tile. bench/triton_fp32_compile.py times the candidates
# (tests/kernels/test_interpret.py checks each); the long tilings' stages would not fit in shared memory anyway.
FP32_CONFIG = (32, 32, 4, 1)  # H200, 2026-12-05: compiled in 7.8 s against 30.4 for (64, 64, 4, 2) (BENCHMARKS.md)
FP32_CANDIDATES = ((64, 64, 4, 2), (16, 32, 2, 1), (32, 64, 4, 1), (16, 16, 1, 1))  # what the bench times beside it


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [T, H, D] packed varlen queries; kv_cache: [2, N, bs, Hkv, D] (any strides, unit in D);
    # k, v: optional [T, Hkv, D] keys/values of this step's tokens (what write_kv stored) -> out [T, H, D];
    # kv_scale: float32 [2] (K, V) of an fp8 cache, whose fresh keys are always read from the cache
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert kv_cache.stride(-1) == 1 and page & (page - 1) == 0
    fp8 = kv_quant.is_fp8(kv_cache)
    fresh = k is not None and v is not None and not fp8
    if fresh:
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
    else:
        k = v = q  # unused
    interp = interpreting()
    bd = pow2(head_dim, 16)
    if config is None:
        long = meta.max_query_len * group >= 512 and bd <= 128 and not interp
        prefix = meta.max_seq_len >= 2 * meta.max_query_len
        config = (PREFIX_CONFIG if prefix else LONG_CONFIG) if long else SHORT_CONFIG
        if q.dtype == torch.float32:
            config = FP32_CONFIG
        if bd > 128:
            config = (config[0], 32, config[2], config[3])
    block_m, block_n, warps, stages = config
    block_m = max(block_m, pow2(group, 16))
    tokens_per_tile = block_m // group
    num_tiles = num_tokens // tokens_per_tile + meta.num_seqs
    grid = (num_tiles, num_kv_heads)
    _prefill_kernel[grid](
        q, kv_cache, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        alibi_slopes if alibi_slopes is not None else q, out, scale_arg(kv_cache, kv_scale, q),
        scale * _LOG2E, meta.num_seqs, tokens_per_tile, num_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        group, head_dim,
        PAGE=page, BLOCK_M=block_m, BLOCK_D=bd, BLOCK_N=block_n, FRESH=fresh, EVEN_D=bd == head_dim,
        HAS_ALIBI=alibi_slopes is not None, UPCAST=interp, IEEE=q.dtype == torch.float32, FP8=fp8,
        num_warps=warps, num_stages=stages,
    )
    return out
