"""Whole-weight dequantization: a quantized weight written out once in the activation dtype, for a plain
cuBLAS matmul over many rows (kernels/triton/dequant_linear.py decides when).

One kernel per layout of kernels/quant.py and kernels/w4_repack.py, each computing what its reference does,
bit for bit: the product formed in fp32 and rounded once to the output dtype.

- W4 repacked (``dequantize_w4_packed``; the reference ``w4_repack.dequantize_packed``): one program per K
  tile of ``tile_k`` inputs and ``BLOCK_N`` outputs; the tile's words shifted by 4j give its j-th
  contiguous slab, the tile lies in one group (one row of zero points and scales), and act-order's rows
  land at ``perm``'s inputs.
- W4 plain (``dequantize_w4``; the reference ``quant.dequantize_w4``): words in input order, zero points
  and scales gathered per input row (``g_idx``, GPTQ's act-order, or k // G).
- per-channel int8 or fp8 (``dequantize_channel``; the reference ``quant.dequantize_channel``).

The W4 weights are written [K, N], the layout their words are in (each program's stores run along N,
as its loads do); ``.t()`` of it is the [N, K] weight ``F.linear`` takes, which cuBLAS reads transposed
with no copy. The per-channel weights are [N, K] already and stay so.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.quant import PACK
from kvrelay.kernels.triton.utils import interpreting
from kvrelay.kernels.w4_repack import W4Packed

# tiles and warps: ~16 values a thread, so that ptxas (sm_90) keeps each kernel near 64 registers, unspilled, and
# many warps are in flight on every SM: all three are memory-bound copies with a little arithmetic
PACKED_TILE = (64, 16)  # the repacked W4 layout: (outputs, warps) per program, over one K tile (the layout's)
PLAIN_TILE = (32, 128, 8)  # the plain W4 layout: (inputs, a multiple of 8: whole words; outputs; warps)
CHANNEL_TILE = (8, 512, 8)  # per-channel weights: (rows, inputs, contiguous; warps)


@triton.jit
def _rounded(w, dtype: tl.constexpr, BY_BITS: tl.constexpr):
    # fp32 -> the output dtype, to nearest even. BY_BITS (bf16 under the interpreter, whose fp32 -> bf16 cast
    # truncates) rounds by hand: add half a unit of bf16's last place (less one ulp where that place is even,
    # so a tie goes to even), then drop the low 16 bits. The compiled cast rounds to nearest even itself
    if BY_BITS:
        bits = w.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = w.to(dtype)
    return y


@triton.jit
def _w4_packed_kernel(w_ptr, s_ptr, z_ptr, p_ptr, out_ptr, N, G, HAS_PERM: tl.constexpr, BY_BITS: tl.constexpr,
                      TILE_K: tl.constexpr, BLOCK_N: tl.constexpr):
    t, pid_n = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rows = t * (TILE_K // 8) + tl.arange(0, TILE_K // 8)
    words = tl.load(w_ptr + rows[:, None].to(tl.int64) * N + rn[None, :], mask=n_mask[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    q = (words[None, :, :] >> shifts[:, None, None]) & 0xF  # [8, TILE_K/8, BN]: slab j, row r
    q = tl.reshape(q, (TILE_K, BLOCK_N)).to(tl.float32)  # row j * TILE_K/8 + r: the tile's inputs in order
    g = (t * TILE_K) // G  # a tile never straddles two groups (w4_repack.tile_k_for)
    z = tl.load(z_ptr + g * N + rn, mask=n_mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + g * N + rn, mask=n_mask, other=0.0).to(tl.float32)
    w = (q - z[None, :]) * s[None, :]
    rk = t * TILE_K + tl.arange(0, TILE_K)
    if HAS_PERM:  # sorted row i holds input perm[i]
        rk = tl.load(p_ptr + rk)
    tl.store(out_ptr + rk[:, None].to(tl.int64) * N + rn[None, :], _rounded(w, out_ptr.dtype.element_ty, BY_BITS),
             mask=n_mask[None, :])


@triton.jit
def _w4_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, G, HAS_GIDX: tl.constexpr, BY_BITS: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = rn < N, rk < K
    rw = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + rw[:, None].to(tl.int64) * N + rn[None, :],
                    mask=(rw < K // 8)[:, None] & n_mask[None, :], other=0)  # [BK/8, BN]
    shifts = tl.arange(0, 8) * 4
    q = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]: nibble j of row r is input 8r + j
    q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
    if HAS_GIDX:
        g = tl.load(g_ptr + rk, mask=k_mask, other=0)
    else:
        g = rk // G
    mask = k_mask[:, None] & n_mask[None, :]
    gn = g[:, None].to(tl.int64) * N + rn[None, :]
    z = tl.load(z_ptr + gn, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + gn, mask=mask, other=0.0).to(tl.float32)
    w = (q - z) * s
    tl.store(out_ptr + rk[:, None].to(tl.int64) * N + rn[None, :], _rounded(w, out_ptr.dtype.element_ty, BY_BITS),
             mask=mask)


@triton.jit
def _channel_kernel(w_ptr, s_ptr, out_ptr, N, K, BY_BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    mask = n_mask[:, None] & (rk < K)[None, :]
    offs = rn[:, None].to(tl.int64) * K + rk[None, :]
    q = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # int8 and e4m3 convert exactly
    s = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _rounded(q * s[:, None], out_ptr.dtype.element_ty, BY_BITS), mask=mask)


def _by_bits(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def _out(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"dequantization needs a contiguous {shape} output, not {tuple(out.shape)}")
    return out


def dequantize_w4_packed(p: W4Packed, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The repacked W4 weight as [K, N] in ``dtype`` (input order: act-order's rows put back), into ``out``
    when given. ``.t()`` equals ``w4_repack.dequantize_packed(p, dtype)``."""
    n, k = p.shape
    out = _out((k, n), dtype, p.qweight.device, out)
    perm = p.perm if p.perm is not None else p.scales  # any pointer: HAS_PERM False never reads it
    block_n, warps = PACKED_TILE
    _w4_packed_kernel[(k // p.tile_k, triton.cdiv(n, block_n))](
        p.qweight, p.scales, p.zeros, perm, out, n, p.group_size, HAS_PERM=p.perm is not None,
        BY_BITS=_by_bits(dtype), TILE_K=p.tile_k, BLOCK_N=block_n, num_warps=warps)
    return out


def dequantize_w4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                  g_idx: torch.Tensor | None, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The plain W4 weight (qweight int32 [K/8, N]) as [K, N] in ``dtype``; ``.t()`` equals
    ``quant.dequantize_w4(..., dtype)``."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    out = _out((k, n), dtype, qweight.device, out)
    block_k, block_n, warps = PLAIN_TILE
    _w4_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        qweight, scales, zeros, g_idx if g_idx is not None else scales, out, n, k, group_size,
        HAS_GIDX=g_idx is not None, BY_BITS=_by_bits(dtype), BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps)
    return out


def dequantize_channel(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """An int8 or fp8 [N, K] weight times its per-channel scale [N], as [N, K] in ``dtype``; equals
    ``quant.dequantize_channel(weight, scale, dtype)``."""
    n, k = weight.shape
    out = _out((n, k), dtype, weight.device, out)
    rows, cols, warps = CHANNEL_TILE
    _channel_kernel[(triton.cdiv(n, rows), triton.cdiv(k, cols))](
        weight, scale, out, n, k, BY_BITS=_by_bits(dtype), BLOCK_N=rows, BLOCK_K=cols, num_warps=warps)
    return out
