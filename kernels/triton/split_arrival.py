"""Split-K partial sums reduced inside the GEMV's own launch: the last split of a column tile to arrive writes the
output. A split adds its fp32 sums into a scratch row, then counts itself in at its tile's counter; the one that
finds every other split already counted reads the whole sum, adds the bias, stores the output in its dtype and
leaves the scratch row and the counter at zero for the next launch.

Why: otherwise a split GEMV is three launches, the fp32 output zeroed, the kernel, and a cast (with the bias) to
bf16, and at batch-1 decode the two small ones cost about as much as a small projection's weight read: 8 extra
launches a layer, 256 a Llama-3-8B step. A stream-K "fixup" done the way CUTLASS's semaphore does it: the CTA's
adds, then a barrier, then one release-acquire increment (Triton has one thread do a scalar atomic and broadcasts
what it returned), so the last arrival sees every split's adds; it reads them from L2 (``.cg``: a stale L1 line
is possible, no atomic there).

The scratch is per process and device, one per (M * N, column tiles): a process's forwards run on one compute
stream (shared/worker/gpu_share.py), so launches using it never overlap, and each launch hands it on zeroed. Never
part of the weights: a process mapping another's weights (shared/engine/weight_arena.py) gets its own.
"""

import torch
import triton
import triton.language as tl

_scratch: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def scratch(device: torch.device, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [n] sums, n an [M, N] output's M * N; int32 [tiles] arrival counters), zeroed once and kept. Made
    before a CUDA graph captures the GEMV (the warm-up's eager forwards run it first); where a capture makes it,
    the graph's pool keeps it."""
    key = (device, n, tiles)
    if key not in _scratch:
        _scratch[key] = (torch.zeros(n, dtype=torch.float32, device=device),
                         torch.zeros(tiles, dtype=torch.int32, device=device))
    return _scratch[key]


@triton.jit
def add_and_finish(acc, offs, cols, mask, ws_ptr, cnt_ptr, y_ptr, b_ptr, pid_n, HAS_BIAS: tl.constexpr):
    """This split's fp32 sums ``acc`` [BLOCK_M, BLOCK_N] added in at ``offs`` (of the [M, N] output and scratch,
    row-major); the last split of column tile ``pid_n`` to arrive stores the output (+ the bias at ``cols``,
    [1, BLOCK_N]) and zeroes the tile's scratch and counter."""
    tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
    tl.debug_barrier()  # every thread's adds issued before the one increment that releases them
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
    if arrived == tl.num_programs(1) - 1:
        total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(ws_ptr + offs, tl.zeros_like(total), mask=mask)
        tl.store(cnt_ptr + pid_n, 0)
