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

Split K, three ways (``reduce``): "order", each split writes its slot of a [SPLIT, M, N] scratch that
w4_fast's ``_split_sum_kernel`` adds in a fixed order (two launches, the same bits every run); "atomic",
every split adds its fp32 partial sums into a zeroed fp32 output (torch.zeros, then a cast: three
launches, order-dependent bits); "last", the splits add into a per-weight fp32 workspace and count their
arrival on the tile's counter, and the last to arrive reads the sums, zeroes them for the next call, adds
the bias and stores the output: one launch. At one decode row the two
extra launches of "atomic" are graph nodes of ~1-2 us each against o's ~3 us weight read, which is why
"last" exists. Its workspace is state, so it is per weight (``workspace``), made on the weight's first
eager call in this process, never shared through a weight arena, and left zeroed by every call: a
layer runs one forward at a time (a worker computes on one stream), so no two calls meet in it.
Without a workspace (a graph captured before any eager call) "last" runs as "atomic".
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from kvrelay.kernels.triton.utils import num_sms, pow2, rows_view
from kvrelay.kernels.triton.w4_fast import SUM_BLOCK, _split_sum_kernel
from kvrelay.kernels.w4_repack import W4Packed

MAX_ROWS = 16  # more rows: the weight is reused enough for the tensor cores (w4_fast)
LAST_ROWS = 4  # rows "last"'s workspace holds: kernels/triton/w4_decode.py's DECODE_MAX_ROWS; more run "atomic"
LOCK_COLUMNS = 16  # "last"'s workspace holds a counter per this many outputs, for tiles of this width or wider
REDUCES = ("order", "atomic", "last")
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
def slab_activations(x_ptr, p_ptr, rk, m, stride_x, M, K, j: tl.constexpr, HAS_PERM: tl.constexpr,
                     SILU: tl.constexpr):
    """Row m's activations at inputs ``rk`` (act-order: gathered through ``perm``) in fp32, scaled for nibble
    j's slab by 16^-(j % 5), as ``nibble_slab`` leaves it (powers of two: exact). ``SILU``: the row is
    gate | up (2K wide) and the input silu(gate) * up, rounded to x's dtype at each step as the unfused
    ops (kernels/triton/silu_mul.py) round it."""
    if HAS_PERM:
        rk = tl.load(p_ptr + rk)
    row_mask = (rk * 0 + m) < M
    x = tl.load(x_ptr + m * stride_x + rk, mask=row_mask, other=0.0)
    if SILU:
        dtype = x_ptr.dtype.element_ty
        up = tl.load(x_ptr + m * stride_x + K + rk, mask=row_mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        x = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)
    return x.to(tl.float32) * 0.0625 ** (j % 5)


@triton.jit
def store_split(acc, y_ptr, b_ptr, rm, rn, M, N, pid_k, stride_split, stride_y, HAS_BIAS: tl.constexpr,
                ATOMIC: tl.constexpr):
    """A split's [BLOCK_M, BLOCK_N] sums: stored (the output, or its fp32 slot) or added to the fp32 output."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if HAS_BIAS:  # one split only: split partials get theirs where they are summed
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_offsets = y_ptr + pid_k.to(tl.int64) * stride_split + rm[:, None] * stride_y + rn[None, :]
    if ATOMIC:
        tl.atomic_add(y_offsets, acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_and_finish_last(acc, y_ptr, b_ptr, sum_ptr, lock_ptr, rm, rn, M, N, pid_n, n_split, stride_y,
                        HAS_BIAS: tl.constexpr):
    """A split's [BLOCK_M, BLOCK_N] sums added into the workspace; the tile's last split to arrive stores
    them (+ bias) as the output and leaves the workspace and the tile's counter at zero."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    sums = sum_ptr + rm[:, None] * N + rn[None, :]
    tl.atomic_add(sums, acc, mask=mask, sem="relaxed")
    # every thread's adds before the arrival (one thread's atomic, made by Triton for a scalar), whose release
    # then covers them; its acquire covers the last split's reads below
    tl.debug_barrier()
    if tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel") == n_split - 1:
        # read where the adds landed, the L2 (an add of zero: the interpreter exchanges no floats), then zeroed
        total = tl.atomic_add(sums, tl.zeros_like(acc), mask=mask, sem="relaxed")
        tl.store(sums, tl.zeros_like(acc), mask=mask)
        if HAS_BIAS:
            total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed")


# the row count and the chunks a split takes vary with the shape and split: compiled once, not per value
@triton.jit(do_not_specialize=["M", "CHUNKS_PER_SPLIT", "n_split"])
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, sum_ptr, lock_ptr, M, N, G, stride_x, stride_y,
                    stride_split, CHUNKS_PER_SPLIT, N_CHUNKS, n_split, magic_bits, HAS_PERM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, LAST: tl.constexpr, SILU: tl.constexpr,
                    TILE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
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
                x = slab_activations(x_ptr, p_ptr, rk, m, stride_x, M, N_CHUNKS * BLOCK_R * 8, j, HAS_PERM, SILU)
                if BLOCK_M == 1 and j == 0:  # not a sum onto zeros: spares the zeroing of the registers
                    part = v * x[:, None]
                elif BLOCK_M == 1:
                    part += v * x[:, None]
                else:
                    chunk += tl.where(rm[:, None] == m, tl.sum(v * x[:, None], axis=0)[None, :], 0.0)
        if BLOCK_M == 1:
            chunk = tl.sum(part, axis=0)[None, :]
        acc += chunk * s[None, :]
    if LAST:
        add_and_finish_last(acc, y_ptr, b_ptr, sum_ptr, lock_ptr, rm, rn, M, N, pid_n, n_split, stride_y, HAS_BIAS)
    else:
        store_split(acc, y_ptr, b_ptr, rm, rn, M, N, pid_k, stride_split, stride_y, HAS_BIAS, ATOMIC)


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


@dataclass(frozen=True)
class Workspace:
    """"last"'s state for one weight: fp32 sums [LAST_ROWS, N] and int32 arrival counters, one per
    ``LOCK_COLUMNS`` outputs; zero between calls."""
    sums: torch.Tensor
    locks: torch.Tensor


_workspaces: WeakIdKeyDictionary = WeakIdKeyDictionary()  # qweight -> its Workspace, gone with the weight


def workspace(p: W4Packed) -> Workspace | None:
    """``p``'s workspace, made zeroed on its first call outside a graph capture (an allocation there would come
    from the graph's pool); None before that."""
    found = _workspaces.get(p.qweight)
    if found is None and not (p.qweight.is_cuda and torch.cuda.is_current_stream_capturing()):
        n, device = p.shape[0], p.qweight.device
        found = _workspaces[p.qweight] = Workspace(
            torch.zeros((LAST_ROWS, n), dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, LOCK_COLUMNS), dtype=torch.int32, device=device))
    return found


def w4_gemv_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None, *, reduce: str = "order",
                   cfg: tuple[int, ...] | None = None, silu: bool = False) -> torch.Tensor:
    """x [..., K] (at most ``MAX_ROWS`` rows) @ the repacked W4 weight -> [..., N], split K summed as ``reduce``
    says (``REDUCES``). ``silu``: x is [..., 2K] gate | up and the input silu(gate) * up, formed as the weight
    streams (no launch of its own). ``cfg``: (BLOCK_N, BLOCK_R, SPLIT, num_warps, num_stages), SPLIT 0 for
    ``split_for``'s; BLOCK_R must divide tile_k / 8."""
    cfg = cfg or default_config(x.numel() // x.shape[-1], *p.shape, p.tile_k, x.device)
    return launch(x, p, bias, reduce, cfg, silu)


def launch(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None, reduce: str, cfg: tuple[int, ...],
           silu: bool = False) -> torch.Tensor:
    """Runs the GEMV over ``p`` with the split-K reduction ``reduce`` names."""
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {', '.join(REDUCES)}; got {reduce!r}")
    n, k = p.shape
    if x.shape[-1] != (2 * k if silu else k):
        raise ValueError(f"input has {x.shape[-1]} features, the W4 weight {k}" + (" (x2: gate | up)" if silu else ""))
    x2 = rows_view(x)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"the W4 GEMV takes at most {MAX_ROWS} rows, not {m}")
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    block_n, block_r, split, warps, stages = cfg
    if (p.tile_k // 8) % block_r:
        raise ValueError(f"BLOCK_R {block_r} does not divide a K tile's {p.tile_k // 8} packed rows")
    n_chunks = k // 8 // block_r
    split = split or split_for(n, block_n, n_chunks, x.device)
    per_split = triton.cdiv(n_chunks, split)
    split = triton.cdiv(n_chunks, per_split)  # no program without a chunk
    space = workspace(p) if reduce == "last" and split > 1 and m <= LAST_ROWS and block_n >= LOCK_COLUMNS else None
    atomic = split > 1 and reduce != "order" and space is None
    sums = locks = p.scales  # unread unless "last" runs
    if split == 1 or space is not None:
        out = y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if space is not None:
            sums, locks = space.sums, space.locks
    elif atomic:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:  # every slot written by its split: no zeroing
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    bias_or_any = bias if bias is not None else p.scales
    _w4_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x2, p.qweight, p.scales, p.zeros, p.perm if p.perm is not None else p.scales, bias_or_any, out, sums, locks,
        m, n, p.group_size, x2.stride(0), n, 0 if atomic else m * n, per_split, n_chunks, split, MAGIC_BITS,
        HAS_PERM=p.perm is not None, HAS_BIAS=bias is not None and (split == 1 or space is not None),
        ATOMIC=atomic, LAST=space is not None, SILU=silu, TILE_K=p.tile_k, BLOCK_M=pow2(m), BLOCK_N=block_n,
        BLOCK_R=block_r, num_warps=warps, num_stages=stages)
    if atomic:
        y = out.to(x.dtype) if bias is None else (out + bias.float()).to(x.dtype)
    elif split > 1 and space is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](out, bias_or_any, y, m * n, n, split,
                                                            HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return y.view(*x.shape[:-1], n)
