"""W4A16 GEMV for one decode row with the weights dequantized and multiplied two at a time, as the fp16 halves
of one 32-bit register (half2), by inline PTX (sm_80+): kernels/triton/w4_gemv.py's grid, chunks, split K and
fp32 atomic sum, with about half its instructions a weight.

Why: w4_gemv.py's one-row loop spends 4.45 instructions a weight (an and-or, a subtraction and an FMA each in
fp32), close enough to the H100's issue rate at the weight's read rate that the GEMV stays at 51-64% of its
weight-read floor. In half2 one instruction treats two weights. A packed word's nibbles pair as i and i + 4
(bits 4i and 16 + 4i, one in each 16-bit lane):

- one shift: the word and the word >> 8 each hold two pairs in the low 8 bits of each lane;
- per pair one LOP3, ``(w & mask) | 0x64006400``, ORs both nibbles into the mantissas of fp16 1024.0: lanes
  1024 + n (mask 0x000F000F), or 1024 + 16n (0x00F000F0: the nibble left in place, still below the exponent);
- per pair one subtraction of the column's (1024 + z) pair, or for the in-place pairs one FMA by 1/16 with the
  column's -(64 + z) pair: n - z either way, exactly (small integers, no rounding), with no shift per pair;
- per pair one FMA (the first a multiplication) with the activations of the two nibbles.

13 instructions for 8 weights. One PTX block takes a column's words of two packed rows (``DOT16``), sums their
16 products in half2 and widens the two lanes to one fp32 sum (2 conversions and an add), which the chunk's
rows add in fp32: 30 instructions for 16 weights, 1.9 a weight. Summing more in half2 would spare part of the
widening but loses accuracy (at Llama-3-8B's K a whole chunk of 8 rows in half2 used up nearly all of the
fp16-output tests' tolerance). The activation and zero-point pairs are built once per chunk, per packed row and
per column; every thread builds those of its rows for all its columns, so more columns a thread (wider tiles,
fewer warps) share them among more words. Compiled offline for sm_90 (ptxas of triton 3.9; 3.6 within 2%),
with the loop's shifts, conversions and addressing: 2.64 instructions a weight at (BLOCK_N, BLOCK_R, warps) =
(1024, 8, 4), 104 registers; 2.35 at (2048, 8, 4), 152; 3.2 at (512, 8, 4), 95; no spills, no shared memory.

fp16's range: the activations are scaled by ``X_SCALE`` = 2^-8 (exact) in fp32 before they round to fp16, and
the sums scaled back in fp32. A lane sums 8 products of |n - z| <= 15, so it stays below fp16's 65,504 while
|x| < 65,504 * 2^8 / 120 ~ 139,000, far above the bf16 activations of real models (thousands at most); unscaled,
it could pass 65,504 from |x| ~ 546. The cost: activations below 2^-6 become fp16 subnormals, off by at most
2^-17 each.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton import split_arrival, w4_gemv
from kvrelay.kernels.triton.utils import interpreting
from kvrelay.kernels.triton.w4_gemv import PROGRAMS_PER_SM, chunk_groups, slab_activations, split_for, store_split
from kvrelay.kernels.w4_repack import W4Packed

X_SCALE = tl.constexpr(2.0 ** -8)
MAGIC = 0x64006400  # fp16 1024.0 in both lanes, whose mantissa's unit is 1
LOW = 0x000F000F  # nibbles 0 and 4 of a word (of the word >> 8: 2 and 6), at each lane's low end
HIGH = 0x00F000F0  # nibbles 1 and 5 (3 and 7) in place: 16n
SIXTEENTH = 0x2C002C00  # fp16 1/16 in both lanes


def _products(word: str, x: int, first: bool) -> str:
    """PTX adding the eight products of the packed word ``word`` into the half2 ``acc`` (``first``: starting it):
    $3 the column's (1024 + z) pair, $4 its -(64 + z) pair, $x to $x+3 the activation pairs of nibble pairs
    0-3 (low lane: nibble i's input, high lane: nibble i + 4's). 0xEA: LOP3's table for (a & b) | c."""
    start = f"mul.rn.f16x2 acc, p0, ${x};" if first else f"fma.rn.f16x2 acc, p0, ${x}, acc;"
    return f"""shr.b32 w8, {word}, 8;
lop3.b32 p0, {word}, {LOW:#010x}, {MAGIC:#010x}, 0xEA;
lop3.b32 p1, {word}, {HIGH:#010x}, {MAGIC:#010x}, 0xEA;
lop3.b32 p2, w8, {LOW:#010x}, {MAGIC:#010x}, 0xEA;
lop3.b32 p3, w8, {HIGH:#010x}, {MAGIC:#010x}, 0xEA;
sub.rn.f16x2 p0, p0, $3;
fma.rn.f16x2 p1, p1, sixteenth, $4;
sub.rn.f16x2 p2, p2, $3;
fma.rn.f16x2 p3, p3, sixteenth, $4;
{start}
fma.rn.f16x2 acc, p1, ${x + 1}, acc;
fma.rn.f16x2 acc, p2, ${x + 2}, acc;
fma.rn.f16x2 acc, p3, ${x + 3}, acc;
"""


# two packed words ($1, $2: one column, two packed rows) -> the fp32 sum of their 16 products, X_SCALE times;
# $5-$8 the first word's activation pairs, $9-$12 the second's
DOT16 = tl.constexpr(
    "{\n.reg .b32 w8, p0, p1, p2, p3, sixteenth, acc;\n.reg .b16 h0, h1;\n.reg .f32 f0, f1;\n"
    f"mov.b32 sixteenth, {SIXTEENTH:#010x};\n" + _products("$1", 5, True) + _products("$2", 9, False)
    + "mov.b32 {h0, h1}, acc;\ncvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\nadd.f32 $0, f0, f1;\n}")
DOT16_CONSTRAINTS = tl.constexpr("=r" + ",r" * 12)


@triton.jit
def half_pair(lo, hi):
    """Two fp32 tensors rounded to fp16 as one half2 (int32): ``lo`` the low half, ``hi`` the high. In PTX: one
    instruction where Triton's conversions and integer packing take two and byte permutes, and opaque to LLVM,
    which narrows ``(x * X_SCALE).to(tl.float16)`` of bf16 activations into a conversion first, one that
    overflows from 65,504, and an fp16 multiplication: the scaling has to happen in fp32."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def activation_pairs(x_ptr, p_ptr, rk, i: tl.constexpr, TILE_K: tl.constexpr, HAS_PERM: tl.constexpr):
    """[R, 1]: the activations of nibbles i and i + 4 of the packed rows whose slab-0 inputs are ``rk``, X_SCALE
    times, as half2 pairs (``slab_activations`` of row 0 of 1, at slab 0's scale of 1)."""
    lo = slab_activations(x_ptr, p_ptr, rk + i * (TILE_K // 8), 0, 0, 1, 0, HAS_PERM)
    hi = slab_activations(x_ptr, p_ptr, rk + (i + 4) * (TILE_K // 8), 0, 0, 1, 0, HAS_PERM)
    return half_pair(lo * X_SCALE, hi * X_SCALE)[:, None]


# the chunks a split takes vary with the shape and split: compiled once, not per value
@triton.jit(do_not_specialize=["CHUNKS_PER_SPLIT"])
def _w4_gemv_h2_kernel(x_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, G, CHUNKS_PER_SPLIT,
                       N_CHUNKS, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                       IN_LAUNCH: tl.constexpr, EVEN_N: tl.constexpr, TILE_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R // 2)  # a chunk's packed rows in two halves, one word of each per DOT16
    n_mask = (rn < N) | EVEN_N  # all true where the tiles divide N: no predicates, no zeroed registers
    rn_4 = rn // 4 * 4 + rn % 4  # contiguous in runs of 4 only: loads and stores in the words' layout (w4_gemv)
    acc = tl.zeros([BLOCK_N], tl.float32)
    c_end = tl.minimum((pid_k + 1) * CHUNKS_PER_SPLIT, N_CHUNKS)
    for c in range(pid_k * CHUNKS_PER_SPLIT, c_end):
        rows = (c * BLOCK_R + rr)[:, None].to(tl.int64) * N + rn[None, :]
        # [BLOCK_R / 2, BLOCK_N]; past N the words are left undefined (no zeroing): their sums are never stored
        first = tl.load(w_ptr + rows, mask=n_mask[None, :])
        second = tl.load(w_ptr + rows + BLOCK_R // 2 * N, mask=n_mask[None, :])
        t, r0, s, z = chunk_groups(s_ptr, z_ptr, c, G, N, rn_4, n_mask, TILE_K, BLOCK_R)
        rk = t * TILE_K + r0 + rr  # the first half's slab-0 inputs; slab j's are j * TILE_K / 8 further
        sums = tl.inline_asm_elementwise(
            DOT16, DOT16_CONSTRAINTS,
            [first, second, half_pair(z + 1024.0, z + 1024.0)[None, :], half_pair(-64.0 - z, -64.0 - z)[None, :],
             activation_pairs(x_ptr, p_ptr, rk, 0, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk, 1, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk, 2, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk, 3, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk + BLOCK_R // 2, 0, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk + BLOCK_R // 2, 1, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk + BLOCK_R // 2, 2, TILE_K, HAS_PERM),
             activation_pairs(x_ptr, p_ptr, rk + BLOCK_R // 2, 3, TILE_K, HAS_PERM)],
            dtype=tl.float32, is_pure=True, pack=1)  # [BLOCK_R / 2, BLOCK_N]
        acc += tl.sum(sums, axis=0) * s
    # rn_4 again: a bf16 output's wider vectors would move every chunk's sums through shared memory into theirs
    if ATOMIC and IN_LAUNCH:
        split_arrival.add_and_finish((acc * (1.0 / X_SCALE))[None, :], rn_4[None, :], rn_4[None, :],
                                     n_mask[None, :], ws_ptr, cnt_ptr, y_ptr, b_ptr, pid_n, HAS_BIAS)
    elif ATOMIC:  # into the zeroed fp32 output, cast after
        tl.atomic_add(y_ptr + rn_4, acc * (1.0 / X_SCALE), mask=n_mask, sem="relaxed")
    else:
        store_split((acc * (1.0 / X_SCALE))[None, :], y_ptr, b_ptr, tl.arange(0, 1), rn_4, 1, N, pid_k, 0, N,
                    HAS_BIAS)


def default_config(n: int, k: int, tile_k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_R, SPLIT, num_warps, num_stages), by bench/quant_kernels.py's one-row sweep at Llama-3-8B's
    shapes on an H100 with the splits reduced in the launch (split_arrival.py), where a split costs one atomic add
    a column: wide projections (gate_up) in 1,024 columns of chunks of 16 packed rows, three stages keeping a
    program's next chunks' words in flight; a long K (down) one chunk a program (14.8 us against 18.3 at two
    chunks of three stages); the small ones 8-row chunks at twice the split, qkv's 6,144 columns in tiles of
    1,024 on two warps (8.8 us against 10.5 in tiles of 512 on four), o's 4,096 in 512 on four."""
    if n >= 16384:
        block_n, block_r, per_sm, warps, stages = 1024, 16, PROGRAMS_PER_SM, 4, 3
    elif k > 8192:
        block_n, block_r, per_sm, warps, stages = 1024, 16, None, 4, 1
    elif n > 4096:
        block_n, block_r, per_sm, warps, stages = 1024, 8, 2 * PROGRAMS_PER_SM, 2, 3
    else:
        block_n, block_r, per_sm, warps, stages = 512, 8, 2 * PROGRAMS_PER_SM, 4, 3
    block_r = min(block_r, tile_k // 8)
    n_chunks = k // 8 // block_r
    split = n_chunks if per_sm is None else split_for(n, block_n, n_chunks, device, per_sm)
    return block_n, block_r, split, warps, stages


def w4_gemv_h2_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None, *,
                      cfg: tuple[int, ...] | None = None, in_launch: bool = True) -> torch.Tensor:
    """x [..., K] @ the repacked W4 weight -> [..., N]. One fp16 or bf16 row on a GPU runs the half2 kernel; the
    rest runs w4_gemv's atomic GEMV: more rows (up to its ``MAX_ROWS``), a row off CUDA or under the interpreter
    (which runs no PTX), and fp32 activations, whose precision fp16 products would not keep. ``cfg``: (BLOCK_N,
    BLOCK_R, SPLIT, num_warps, num_stages) as w4_gemv_linear's; the half2 kernel's BLOCK_R even. ``in_launch``
    False: the splits add into a zeroed fp32 output that a cast (with the bias) turns into the result, three
    launches where the default's one (split_arrival.py) reduces them: the same-process baseline the decode table's
    ``w4_gemv_h2_3launch`` entry keeps for ``bench quant``."""
    if x.numel() != x.shape[-1] or not x.is_cuda or interpreting() or x.dtype == torch.float32:
        return w4_gemv.w4_gemv_linear(x, p, bias, atomic=True, cfg=cfg)
    return launch(x, p, bias, cfg or default_config(*p.shape, p.tile_k, x.device), in_launch)


def launch(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None, cfg: tuple[int, ...],
           in_launch: bool = True) -> torch.Tensor:
    """Runs the half2 kernel over one row ``x`` [..., K]."""
    n = p.shape[0]
    x2, n_chunks, split, per_split = w4_gemv.plan(x, p, cfg)
    block_n, block_r, _, warps, stages = cfg
    if x2.shape[0] != 1:
        raise ValueError(f"the half2 GEMV takes one row, not {x2.shape[0]}")
    if block_r % 2:
        raise ValueError(f"BLOCK_R {block_r} is odd: a chunk's packed rows go in two halves")
    tiles = triton.cdiv(n, block_n)
    summed_after = split > 1 and not in_launch
    if summed_after:
        out = torch.zeros((1, n), dtype=torch.float32, device=x.device)
    else:  # every column written by its one program or its tile's last split
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, counters = split_arrival.scratch(x.device, n, tiles) if split > 1 and in_launch else (out, out)
    _w4_gemv_h2_kernel[(tiles, split)](
        x2, p.qweight, p.scales, p.zeros, p.perm if p.perm is not None else p.scales,
        bias if bias is not None else p.scales, out, ws, counters, n, p.group_size, per_split, n_chunks,
        HAS_PERM=p.perm is not None, HAS_BIAS=bias is not None and not summed_after, ATOMIC=split > 1,
        IN_LAUNCH=in_launch, EVEN_N=n % block_n == 0, TILE_K=p.tile_k, BLOCK_N=block_n, BLOCK_R=block_r,
        num_warps=warps, num_stages=stages)
    if summed_after:
        out = (out if bias is None else out + bias.float()).to(x.dtype)
    return out.view(*x.shape[:-1], n)
