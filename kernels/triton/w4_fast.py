"""W4A16 matmul over the repacked layout (kernels/w4_repack.py): one kernel for decode rows and prefill.

Per K tile of ``tile_k`` inputs and ``BLOCK_N`` outputs the loop loads [tile_k/8, BLOCK_N] packed words,
and per element does a shift and a mask-or (the nibble OR'd into the mantissa of fp16 1024.0, which the
compiler may fuse into one three-input logic op), a truncation and a bitcast to fp16, a subtraction of the
``1024 + zero`` folded once per tile and column, and a multiplication by the group's scale: no integer-to-float conversion, the
cost that kept kernels/triton/w4a16.py at 14% of its weight-read floor. The products run on the tensor
cores (``tl.dot``, fp32 accumulation) whatever the row count: a decode row pads to a 16-row tile, which
costs tensor-core cycles the weight-bound loop has to spare, and leaves the FMA units to dequantization.

The dequantization's arithmetic: ``bits - (1024 + z)`` is exact in fp16 (integers below 2048). fp16
activations then multiply by the scale in fp16, one rounding, as the reference rounds its fp32 product.
bf16 (and fp32) activations widen that integer to fp32 and multiply there: a product formed in fp16 and
converted to bf16 would round twice, and fp16 scales rounded to bf16 (Marlin's choice for bf16) would
shift every weight of a group the same way; the fp32 route costs the same two conversions per element
as fp16 math followed by a conversion to bf16 would.

Split-K: with few output tiles (the qkv, o and down projections at one row: 96, 64 and 64 tiles of 64
outputs against 132 SMs) ``SPLIT`` programs share the K loop of one tile. Each writes its fp32 partial sums
to its own slot of a [SPLIT, M, N] scratch, and a second launch (``_split_sum_kernel``) adds the slots in a
fixed order, adds the bias and casts to the output dtype; with one split the kernel writes the output
dtype directly, bias included. Why not atomics into fp32: they need the buffer zeroed (a memset) and a cast
back (a third launch), or a cached buffer that the cast re-zeroes (two launches, as here, but state shared
by every caller of a shape: two streams, or a graph and an eager call, would race on it). The bytes are
alike: at 16 decode rows the scratch is SPLIT * 16 * N * 4 bytes (1 MiB at o's SPLIT 4), written and read
back through the L2, against o's 8.4 MB and down's 29 MB of weights from HBM; atomics move the same partials
through the L2 as read-modify-writes. What differs is launches, each with a fixed cost of the order of a
microsecond against o's ~2 us weight read at HBM speed: two, with no state, and the same bits every run.
(One launch, the last program of a tile summing the slots, would need a per-tile arrival counter kept zeroed
between calls: the shared state again.)
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.decode_attention import _dot
from kvrelay.kernels.triton.utils import interpreting, num_sms, rows_view
from kvrelay.kernels.w4_repack import W4Packed

PROGRAMS_PER_SM = 2  # a weight-bound loop wants several tiles in flight on every SM
SUM_BLOCK = 512  # split-K sum: outputs per program, 4 fp32 per thread of 4 warps (16-byte loads)


@triton.jit
def _w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, M, N, K, G, stride_x, stride_y, stride_split,
               TILES_PER_SPLIT, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
               UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TILE_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, TILE_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    t_end = tl.minimum((pid_k + 1) * TILES_PER_SPLIT, K // TILE_K)
    for t in range(pid_k * TILES_PER_SPLIT, t_end):
        k0 = t * TILE_K
        rk = k0 + tl.arange(0, TILE_K)
        if HAS_PERM:
            rk = tl.load(p_ptr + rk)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=m_mask[:, None], other=0.0)
        words = tl.load(w_ptr + (k0 // 8 + rows)[:, None].to(tl.int64) * N + rn[None, :], mask=n_mask[None, :],
                        other=0)  # [TILE_K/8, BLOCK_N]
        bits = ((words[None, :, :] >> shifts[:, None, None]) & 0xF) | 0x6400  # slab j = nibble j
        v = tl.reshape(bits.to(tl.int16).to(tl.float16, bitcast=True), (TILE_K, BLOCK_N))  # 1024 + q
        g = k0 // G
        s = tl.load(s_ptr + g * N + rn, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + g * N + rn, mask=n_mask, other=0).to(tl.float16) + 1024.0
        if HALF:
            w = (v - z[None, :]) * s[None, :]
        else:
            w = (v - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]
        acc += _dot(x, w.to(dtype), UPCAST, IEEE)
    if HAS_BIAS:  # one split only: split partials get theirs in _split_sum_kernel
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # y: the output, or (split K) this split's fp32 slot of the scratch, every element written
    y_offsets = y_ptr + pid_k.to(tl.int64) * stride_split + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    tl.store(y_offsets, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, MN, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # y [M, N] = the SPLIT fp32 slots [SPLIT, M, N] added in order (+ bias), in y's dtype
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    part = part_ptr + offs
    acc = tl.load(part, mask=mask, other=0.0)
    for _ in range(1, SPLIT):
        part += MN
        acc += tl.load(part, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, n: int, k_tiles: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT): a 16-row tile for decode, larger ones for prefill, and K split until
    ``PROGRAMS_PER_SM`` programs per SM are in flight. A first choice: bench/quant_kernels.py's sweep
    (format ``w4_fast``) on the H200 is what to tune it against."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while split * 2 <= k_tiles and tiles * split * 2 <= PROGRAMS_PER_SM * num_sms(device):
        split *= 2
    return block_m, block_n, split


def w4_packed_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None, *,
                     cfg: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [..., K] @ the repacked W4 weight -> [..., N]. ``cfg`` (BLOCK_M, BLOCK_N, SPLIT, optionally
    num_warps, num_stages) forces a shape for tests and sweeps; BLOCK_M and BLOCK_N at least 16."""
    n, k = p.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the W4 weight {k}")
    x2 = rows_view(x)
    m = x2.shape[0]
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    k_tiles = k // p.tile_k
    block_m, block_n, split, *launch = cfg or default_config(m, n, k_tiles, x.device)
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no program without a tile
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # no zeroing: every program stores its whole tile, and every split has a tile (above)
    part = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    flags = dict(HAS_PERM=p.perm is not None, HAS_BIAS=bias is not None and split == 1,
                 HALF=x.dtype == torch.float16, UPCAST=interpreting(), IEEE=x.dtype == torch.float32,
                 BLOCK_M=block_m, BLOCK_N=block_n, TILE_K=p.tile_k)
    if launch:
        flags.update(num_warps=launch[0], num_stages=launch[1])
    bias_or_any = bias if bias is not None else p.scales
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    _w4_kernel[grid](x2, p.qweight, p.scales, p.zeros, p.perm if p.perm is not None else p.scales, bias_or_any,
                     part, m, n, k, p.group_size, x2.stride(0), part.stride(-2), m * n, per_split, **flags)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](part, bias_or_any, y, m * n, n, split,
                                                            HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return y.view(*x.shape[:-1], n)
