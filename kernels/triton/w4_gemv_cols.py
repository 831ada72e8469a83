"""W4A16 GEMV for one decode row, each program a few output columns over the whole K: one launch, no split-K
partials to zero, add or cast. kernels/triton/w4_gemv.py splits K until the programs fill the GPU, so each reads
one or two chunks of words and ends, and its splits meet in fp32 atomics on the same outputs; here a program
streams its columns' words down the whole K, its loads one step after another. Which reads the weight at a larger
share of the bandwidth is for the GPU to say (bench/quant_kernels.py's sweep, ``bench quant --variants
awq@w4_gemv_cols``): a candidate of kernels/triton/w4_decode.py's table, not its default.

The weight is the repacked layout (kernels/w4_repack.py), nibbles interleaved per K tile. A program takes
``BLOCK_N`` columns and walks K ``TILES`` K tiles at a time: the words are a [TILES, tile_k / 8, BLOCK_N] block
(``TILES * tile_k / 2 * BLOCK_N`` bytes in flight a program, enough that a few programs an SM keep the memory
busy), each tile's scales and zero points a [TILES, BLOCK_N] block (a tile never straddles a group). Nibble j of
the words is slab j of each tile (kernels/triton/w4_gemv.py's ``nibble_slab``: a mask, an OR into 2^23's mantissa,
a subtraction, against activations pre-scaled by 16^-j), summed over the eight slabs, scaled once per word and
kept per element until the end: the one reduction across threads happens once a program, not per chunk.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.utils import num_sms, rows_view
from kvrelay.kernels.triton.w4_gemv import MAGIC_BITS, nibble_slab, w4_gemv_linear
from kvrelay.kernels.w4_repack import W4Packed


@triton.jit
def _w4_cols_kernel(x_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, N, G, N_TILES, magic_bits,
                    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, TILE_K: tl.constexpr, TILES: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    R: tl.constexpr = TILE_K // 8  # packed rows a K tile
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rt = tl.arange(0, TILES)
    rr = tl.arange(0, R)
    n_mask = rn < N
    acc = tl.zeros([TILES, R, BLOCK_N], tl.float32)
    for t0 in range(0, N_TILES, TILES):
        t = t0 + rt  # [TILES]
        t_mask = t < N_TILES
        mask = t_mask[:, None, None] & n_mask[None, None, :]
        rows = (t[:, None] * R + rr[None, :]).to(tl.int64)  # [TILES, R] packed rows
        words = tl.load(w_ptr + rows[:, :, None] * N + rn[None, None, :], mask=mask, other=0)
        g = (t * TILE_K // G).to(tl.int64)
        gmask = t_mask[:, None] & n_mask[None, :]
        s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=gmask, other=0.0).to(tl.float32)  # [TILES, BLOCK_N]
        z = tl.load(z_ptr + g[:, None] * N + rn[None, :], mask=gmask, other=0).to(tl.float32)
        part = tl.zeros([TILES, R, BLOCK_N], tl.float32)
        for j in tl.static_range(8):
            rk = t[:, None] * TILE_K + j * R + rr[None, :]  # [TILES, R]: slab j of each tile
            if HAS_PERM:
                rk = tl.load(p_ptr + rk, mask=t_mask[:, None], other=0)
            x = tl.load(x_ptr + rk, mask=t_mask[:, None], other=0.0).to(tl.float32) * 0.0625 ** (j % 5)
            v = nibble_slab(words, z[:, None, :], j, magic_bits)
            if j == 0:
                part = v * x[:, :, None]
            else:
                part += v * x[:, :, None]
        acc += part * s[:, None, :]
    y = tl.sum(tl.sum(acc, axis=1), axis=0)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def default_config(n: int, k: int, tile_k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, TILES, num_warps, num_stages): 32 columns a program where that still makes two programs an SM,
    else 16 (Llama-3-8B's qkv, o and down have 4,096-6,144 outputs: 32 columns would leave one program an SM);
    each step ~16 KiB of words a program (8 K tiles of 128 at 32 columns, 16 at 16), 4 warps. Set before any
    sweep: bench/quant_kernels.py's says better."""
    block_n = 32 if n // 32 >= 2 * num_sms(device) else 16
    return block_n, max(1, min(8 * 32 // block_n, triton.next_power_of_2(k // tile_k))), 4, 1


def w4_cols_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None,
                   cfg: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ the repacked W4 weight -> [..., N]. ``cfg``: (BLOCK_N, TILES, num_warps,
    num_stages), TILES a power of two."""
    n, k = p.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the W4 weight {k}")
    x2 = rows_view(x)
    if x2.shape[0] != 1:
        raise ValueError(f"the column GEMV takes one row, not {x2.shape[0]}")
    block_n, tiles, warps, stages = cfg or default_config(n, k, p.tile_k, x.device)
    if tiles & (tiles - 1):
        raise ValueError(f"TILES must be a power of two, not {tiles}")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _w4_cols_kernel[(triton.cdiv(n, block_n),)](
        x2, p.qweight, p.scales, p.zeros, p.perm if p.perm is not None else p.scales,
        bias if bias is not None else p.scales, y, n, p.group_size, k // p.tile_k, MAGIC_BITS,
        HAS_PERM=p.perm is not None, HAS_BIAS=bias is not None, TILE_K=p.tile_k, TILES=tiles, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], n)


def w4_cols_or_gemv(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None, *, atomic: bool) -> torch.Tensor:
    """One row through ``w4_cols_linear``; more through kernels/triton/w4_gemv.py's split K (``atomic``: by atomics)."""
    if x.numel() // x.shape[-1] == 1:
        return w4_cols_linear(x, p, bias)
    return w4_gemv_linear(x, p, bias, atomic=atomic)
