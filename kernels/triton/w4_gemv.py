"""W4A16 GEMV for decode rows (1-16) over the repacked layout (kernels/w4_repack.py): no tensor cores, the
weight streamed once at the memory's pace, the products summed on the FMA units.

Why not kernels/triton/w4_fast.py's ``tl.dot`` for a decode row: the dot pads one row to a 16-row tile, and
its operand goes through shared memory in the tensor cores' layout every K tile; the weight read is then
not what bounds the loop. Here each thread owns runs of 4 consecutive output columns (one 16-byte load a
packed row; BLOCK_N / (128 x num_warps) runs) and ``BLOCK_R`` packed rows of a K tile, so the K sum stays in
the thread's registers (no shuffle, no shared memory) whenever ``BLOCK_N`` is 128 x num_warps or more. One
row keeps a partial sum per weight and adds them once per chunk; more rows add each slab's products per
row (registers per row would spill), so they cost an FMUL and an FADD a weight and row, not one FFMA.

Per packed word (eight 4-bit weights) the arithmetic is one shift, eight and-or's (a nibble masked in
place and OR'd into the mantissa of fp32 2^23, one LOP3 each), eight subtractions and eight FMAs. Nibble j
in place is worth q * 16^j: ``bits - (2^23 + z * 16^j)`` is (q - z) * 16^j exactly (integers below 2^24),
and the activation it multiplies is pre-scaled by 16^-j (exact: a power of two), so the product rounds as
(q - z) * x would. Nibbles 5-7 would reach the exponent, so they come from the word shifted right by 20
once. The classic extraction (every nibble shifted down first: one more integer op per weight) and a
K-major copy of the words were tried and lost at every Llama-3-8B shape (BENCHMARKS.md, "The W4 decode
GEMV variants"). The scale multiplies once per column and chunk of ``BLOCK_R`` rows (a chunk never
straddles a group: K tiles divide the group size).
Compiled offline for sm_90 (triton 3.9's ptxas), one row at (BLOCK_N, BLOCK_R, warps) = (1024, 8, 4): 4.45
instructions a weight in the loop (LOP3, FADD, FFMA each 1; shifts, conversions of the activations and
addressing the rest), no shared memory, no spills at 255 registers; (512, 8, 4): 5.1 at 128 registers;
the classic extraction 5.9. At the H100's ~30 T thread-instructions/s that is ~3.3 TB/s of packed weight
at 4.45, above the copy bandwidth (2.85 TB/s): issue-bound only if latency is not hidden.

The packed layout interleaves nibbles per K tile (slab j of a tile is the j-th contiguous run of
``tile_k / 8`` inputs), so the activations a slab multiplies are a contiguous run too; act-order gathers
them through ``perm``.

Split K: with ``ATOMIC`` every split adds its fp32 partial sums into a scratch and the last to arrive writes
the output (kernels/triton/split_arrival.py: one launch, order-dependent bits); without it each split writes its
slot of a [SPLIT, M, N] scratch that w4_fast's ``_split_sum_kernel`` adds in a fixed order (two launches, the same
bits every run), the trade described in kernels/triton/w4_fast.py.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton import split_arrival
from kvrelay.kernels.triton.utils import num_sms, pow2, rows_view
from kvrelay.kernels.triton.w4_fast import SUM_BLOCK, _split_sum_kernel
from kvrelay.kernels.w4_repack import W4Packed

MAX_ROWS = 16  # more rows: the weight is reused enough for the tensor cores (w4_fast)
PROGRAMS_PER_SM = 4
MAGIC = tl.constexpr(8388608.0)  # 2^23, whose mantissa's unit is 1
# its bits, passed as an argument: a constant would take LOP3's one immediate slot, leaving each nibble's mask
# to be rematerialized in a register (a MOV per and-or under register pressure)
MAGIC_BITS = 0x4B000000


@triton.jit
def nibble_slab(words, z, j: tl.constexpr, magic_bits):
    """Nibble j of each packed word as fp32 (q - z) * 16^(j % 5); ``z`` the zero points broadcast to the words'
    shape. Nibbles 5-7 come from the words shifted right by 20 once (the compiler merges the three shifts)."""
    if j < 5:
        bits = (words & (15 << (4 * j))) | magic_bits
    else:
        high = (words.to(tl.uint32, bitcast=True) >> 20).to(tl.int32, bitcast=True)
        bits = (high & (15 << (4 * (j - 5)))) | magic_bits
    return bits.to(tl.float32, bitcast=True) - (MAGIC + z * 16.0 ** (j % 5))


@triton.jit
def chunk_groups(s_ptr, z_ptr, c, G, N, rn, n_mask, TILE_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Chunk c's K tile, its first packed row there, and its group's scales and zero points (fp32) at ``rn``."""
    t = c // (TILE_K // 8 // BLOCK_R)
    g = t * TILE_K // G
    s = tl.load(s_ptr + g * N + rn, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + rn, mask=n_mask, other=0).to(tl.float32)
    return t, c % (TILE_K // 8 // BLOCK_R) * BLOCK_R, s, z


@triton.jit
def slab_activations(x_ptr, p_ptr, rk, m, stride_x, M, j: tl.constexpr, HAS_PERM: tl.constexpr):
    """Row m's activations at inputs ``rk`` (act-order: gathered through ``perm``) in fp32, scaled for nibble
    j's slab by 16^-(j % 5), as ``nibble_slab`` leaves it (powers of two: exact)."""
    if HAS_PERM:
        rk = tl.load(p_ptr + rk)
    x = tl.load(x_ptr + m * stride_x + rk, mask=(rk * 0 + m) < M, other=0.0).to(tl.float32)
    return x * 0.0625 ** (j % 5)


@triton.jit
def store_split(acc, y_ptr, b_ptr, rm, rn, M, N, pid_k, stride_split, stride_y, HAS_BIAS: tl.constexpr):
    """A split's [BLOCK_M, BLOCK_N] sums stored: the output (one split), or the split's fp32 slot."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if HAS_BIAS:  # one split only: split partials get theirs where they are summed
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_offsets = y_ptr + pid_k.to(tl.int64) * stride_split + rm[:, None] * stride_y + rn[None, :]
    tl.store(y_offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)


# the row count and the chunks a split takes vary with the shape and split: compiled once, not per value
@triton.jit(do_not_specialize=["M", "CHUNKS_PER_SPLIT"])
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, G, stride_x, stride_y,
                    stride_split, CHUNKS_PER_SPLIT, N_CHUNKS, magic_bits, HAS_PERM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, TILE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    n_mask = rn < N
    # rn, known contiguous in runs of 4 only: the scales' and zero points' loads then take the words' layout
    # (4 columns a thread) instead of wider vectors of their narrower types, which would move the words
    # through shared memory into theirs every chunk
    rn_4 = rn // 4 * 4 + rn % 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    c_end = tl.minimum((pid_k + 1) * CHUNKS_PER_SPLIT, N_CHUNKS)
    for c in range(pid_k * CHUNKS_PER_SPLIT, c_end):
        words = tl.load(w_ptr + (c * BLOCK_R + rr)[:, None].to(tl.int64) * N + rn[None, :], mask=n_mask[None, :],
                        other=0)  # [BLOCK_R, BLOCK_N]
        t, r0, s, z = chunk_groups(s_ptr, z_ptr, c, G, N, rn_4, n_mask, TILE_K, BLOCK_R)
        # one row: products summed per element, over the chunk's rows once; more: summed per slab and row
        part = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        chunk = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(8):
            rk = t * TILE_K + j * (TILE_K // 8) + r0 + rr  # slab j: the tile's j-th run of tile_k / 8 inputs
            v = nibble_slab(words, z[None, :], j, magic_bits)
            for m in tl.static_range(BLOCK_M):
                x = slab_activations(x_ptr, p_ptr, rk, m, stride_x, M, j, HAS_PERM)
                if BLOCK_M == 1 and j == 0:  # not a sum onto zeros: spares the zeroing of the registers
                    part = v * x[:, None]
                elif BLOCK_M == 1:
                    part += v * x[:, None]
                else:
                    chunk += tl.where(rm[:, None] == m, tl.sum(v * x[:, None], axis=0)[None, :], 0.0)
        if BLOCK_M == 1:
            chunk = tl.sum(part, axis=0)[None, :]
        acc += chunk * s[None, :]
    if ATOMIC:
        split_arrival.add_and_finish(acc, rm[:, None] * N + rn[None, :], rn[None, :],
                                     (rm < M)[:, None] & n_mask[None, :], ws_ptr, cnt_ptr, y_ptr, b_ptr, pid_n,
                                     HAS_BIAS)
    else:
        store_split(acc, y_ptr, b_ptr, rm, rn, M, N, pid_k, stride_split, stride_y, HAS_BIAS)


def default_config(m: int, n: int, k: int, tile_k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_R, SPLIT, num_warps, num_stages): 512 columns of 4 warps (4 a thread, one 16-byte word a
    packed row); one row in chunks of 8 packed rows with K split until twice ``PROGRAMS_PER_SM`` programs per SM
    are in flight, more rows in chunks of 4 (the per-row sums stay in registers) at ``PROGRAMS_PER_SM``. From
    bench/quant_kernels.py's sweep picks them (BENCHMARKS.md: at one row, 512 columns and twice the split beat
    1,024 columns); at four rows the default was within a few percent of the best."""
    block_n, block_r, per_sm = (512, 8, 2 * PROGRAMS_PER_SM) if m == 1 else (512, 4, PROGRAMS_PER_SM)
    block_r = min(block_r, tile_k // 8)
    return block_n, block_r, split_for(n, block_n, k // 8 // block_r, device, per_sm), 4, 1


def split_for(n: int, block_n: int, n_chunks: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split * 2 <= n_chunks and tiles * split < per_sm * num_sms(device):
        split *= 2
    return split


def w4_gemv_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None, *, atomic: bool = False,
                   cfg: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [..., K] (at most ``MAX_ROWS`` rows) @ the repacked W4 weight -> [..., N]. ``cfg``: (BLOCK_N, BLOCK_R,
    SPLIT, num_warps, num_stages), SPLIT 0 for ``split_for``'s; BLOCK_R must divide tile_k / 8."""
    return launch(x, p, bias, atomic, cfg or default_config(x.numel() // x.shape[-1], *p.shape, p.tile_k, x.device))


def launch(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None, atomic: bool, cfg: tuple[int, ...]) -> torch.Tensor:
    """Runs the GEMV over ``p`` with the split-K reduction ``atomic`` asks for."""
    n = p.shape[0]
    x2, n_chunks, split, per_split = plan(x, p, cfg)
    m = x2.shape[0]
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    block_n, block_r, _, warps, stages = cfg
    tiles = triton.cdiv(n, block_n)
    atomic = atomic and split > 1
    out = split_output(m, n, split, atomic, x)
    ws, counters = split_arrival.scratch(x.device, m * n, tiles) if atomic else (out, out)
    _w4_gemv_kernel[(tiles, split)](
        x2, p.qweight, p.scales, p.zeros, p.perm if p.perm is not None else p.scales,
        bias if bias is not None else p.scales, out, ws, counters, m, n, p.group_size, x2.stride(0), n, m * n,
        per_split, n_chunks, MAGIC_BITS, HAS_PERM=p.perm is not None,
        HAS_BIAS=bias is not None and (split == 1 or atomic), ATOMIC=atomic, TILE_K=p.tile_k, BLOCK_M=pow2(m),
        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=warps, num_stages=stages)
    return split_result(out, bias, split, atomic, x.dtype).view(*x.shape[:-1], n)


def plan(x: torch.Tensor, p: W4Packed, cfg: tuple[int, ...]) -> tuple[torch.Tensor, int, int, int]:
    """(x as [M, K] rows, chunks of BLOCK_R packed rows, SPLIT, chunks a split takes) for ``cfg``, the shapes
    checked: its SPLIT 0 takes ``split_for``'s, and no split is left without a chunk."""
    n, k = p.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the W4 weight {k}")
    x2 = rows_view(x)
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"the W4 GEMV takes at most {MAX_ROWS} rows, not {x2.shape[0]}")
    block_n, block_r, split = cfg[:3]
    if (p.tile_k // 8) % block_r:
        raise ValueError(f"BLOCK_R {block_r} does not divide a K tile's {p.tile_k // 8} packed rows")
    n_chunks = k // 8 // block_r
    per_split = triton.cdiv(n_chunks, split or split_for(n, block_n, n_chunks, x.device))
    return x2, n_chunks, triton.cdiv(n_chunks, per_split), per_split


def split_output(m: int, n: int, split: int, atomic: bool, x: torch.Tensor) -> torch.Tensor:
    """What the kernel writes: the [M, N] output itself (one split, or atomic: the last split to arrive writes it,
    split_arrival.py), or each split's fp32 slot of a [SPLIT, M, N] scratch, every slot written (no zeroing)."""
    if split == 1 or atomic:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    return torch.empty((split, m, n), dtype=torch.float32, device=x.device)


def split_result(out: torch.Tensor, bias: torch.Tensor | None, split: int, atomic: bool,
                 dtype: torch.dtype) -> torch.Tensor:
    """The [M, N] output from ``split_output``'s tensor, written: slots in order get the bias as w4_fast's
    ``_split_sum_kernel`` adds them in a fixed order; the other two are the output already."""
    if split == 1 or atomic:
        return out
    m, n = out.shape[1:]
    y = torch.empty((m, n), dtype=dtype, device=out.device)
    _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](out, bias if bias is not None else out, y, m * n, n, split,
                                                        HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return y
