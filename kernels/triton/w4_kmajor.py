"""W4A16 GEMV over a K-major copy of the repacked W4 weight: each output's packed words in one contiguous run.

kernels/triton/w4_gemv.py reads ``qweight`` [K/8, N] (outputs the fast axis: a warp's 16-byte loads cover 128
outputs of one packed row); here the same words are transposed to [N, K/8], so a program of ``BLOCK_N``
outputs streams ``BLOCK_N`` runs of ``BLOCK_R`` words per chunk, each thread owning 4 consecutive words of
one output (16 bytes, 32 inputs) and, with more outputs than lanes along them, several outputs at the same
inputs (the activations it converts serve them all). The nibbles stay interleaved per K tile as in the
packed layout, so slab j of a chunk multiplies a contiguous run of activations; the arithmetic is
w4_gemv's (``nibble_slab``), the partial sums stay per word position until the split's end, where the
lanes that share an output add theirs.

A benchmark variant (bench/quant_kernels.py, format ``w4_kmajor``): the engine's W4 layers keep the
[K/8, N] words the prefill kernel reads, and a second copy would double the weight bytes. Split K writes
per-split fp32 slots that kernels/triton/w4_fast.py's ``_split_sum_kernel`` adds in order.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.w4_gemv import (
    chunk_groups,
    launch,
    nibble_slab,
    slab_activations,
    split_for,
    store_split,
)
from kvrelay.kernels.w4_repack import W4Packed

PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class W4KMajor:
    qweight: torch.Tensor  # int32 [N, K/8]: W4Packed's words, transposed
    scales: torch.Tensor  # fp16 [K/G, N], as W4Packed's
    zeros: torch.Tensor  # uint8 [K/G, N]
    perm: torch.Tensor | None
    group_size: int
    tile_k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 8


def to_kmajor(p: W4Packed) -> W4KMajor:
    return W4KMajor(p.qweight.t().contiguous(), p.scales, p.zeros, p.perm, p.group_size, p.tile_k)


# the row count and the chunks a split takes vary with the shape and split: compiled once, not per value
@triton.jit(do_not_specialize=["M", "CHUNKS_PER_SPLIT"])
def _w4_kmajor_kernel(x_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, M, N, G, stride_x, stride_y, stride_split,
                      CHUNKS_PER_SPLIT, N_CHUNKS, magic_bits, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ATOMIC: tl.constexpr, SHIFT_FREE: tl.constexpr, TILE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    # the activations' offsets known contiguous in runs of 4 only: their loads then take the words' layout
    # (4 words a thread), where 8-wide bf16 vectors would be moved into it through shared memory
    rr_4 = rr // 4 * 4 + rr % 4
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_1 = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)  # one row: per word position, summed at the end
    c_end = tl.minimum((pid_k + 1) * CHUNKS_PER_SPLIT, N_CHUNKS)
    for c in range(pid_k * CHUNKS_PER_SPLIT, c_end):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * (N_CHUNKS * BLOCK_R) + (c * BLOCK_R + rr)[None, :],
                        mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_R]
        t, r0, s, z = chunk_groups(s_ptr, z_ptr, c, G, N, rn, n_mask, TILE_K, BLOCK_R)
        part = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
        chunk = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(8):
            rk = t * TILE_K + j * (TILE_K // 8) + r0 + rr_4  # slab j: the tile's j-th run of tile_k / 8 inputs
            v = nibble_slab(words, z[:, None], j, magic_bits, SHIFT_FREE)
            for m in tl.static_range(BLOCK_M):
                x = slab_activations(x_ptr, p_ptr, rk, m, stride_x, M, j, HAS_PERM, SHIFT_FREE)
                if BLOCK_M == 1:
                    part += v * x[None, :]
                else:  # several rows: summed across the lanes each slab (the per-row registers would spill)
                    chunk += tl.where(rm[:, None] == m, tl.sum(v * x[None, :], axis=1)[None, :], 0.0)
        if BLOCK_M == 1:
            acc_1 += part * s[:, None]
        else:
            acc += chunk * s[None, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc_1, axis=1)[None, :]
    store_split(acc, y_ptr, b_ptr, rm, rn, M, N, pid_k, stride_split, stride_y, HAS_BIAS, ATOMIC)


def default_config(m: int, n: int, k: int, tile_k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_R, SPLIT, num_warps, num_stages): 128 outputs x 16 words (4 outputs a thread, 64
    contiguous bytes each; 8 words for more rows), K split until ``PROGRAMS_PER_SM`` programs per SM are in
    flight."""
    block_n, block_r = 128, min(16 if m == 1 else 8, tile_k // 8)
    return block_n, block_r, split_for(n, block_n, k // 8 // block_r, device, PROGRAMS_PER_SM), 4, 1


def w4_kmajor_linear(x: torch.Tensor, p: W4KMajor, bias: torch.Tensor | None = None, *, atomic: bool = False,
                     shift_free: bool = True, cfg: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [..., K] (at most ``MAX_ROWS`` rows) @ the K-major W4 weight -> [..., N]; ``cfg`` as w4_gemv_linear's."""
    return launch(_w4_kmajor_kernel, x, p, bias, atomic, shift_free,
                  cfg or default_config(x.numel() // x.shape[-1], *p.shape, p.tile_k, x.device))
