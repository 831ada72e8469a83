"""Which kernel a W4 matmul over the repacked layout (kernels/w4_repack.py) runs, by row count: the one table
to change when the GPU's numbers say so (bench/quant_kernels.py, formats w4_fast and w4_gemv*).

``DECODE_KERNEL`` names the kernel for up to ``DECODE_MAX_ROWS`` rows (decode steps of a small batch); more
rows, and "w4_fast", take kernels/triton/w4_fast.py (tensor cores). Every entry reads the same weight
bytes: switching needs no change to the loading. From kernels/triton/dequant_linear.py's ``DEQUANT_MIN_ROWS`` rows
on, the registered op comes here no more: it dequantizes the weight and calls cuBLAS.
"""

import functools

import torch

from kvrelay.kernels.triton import w4_fast, w4_gemv, w4_gemv_h2
from kvrelay.kernels.w4_repack import W4Packed

DECODE_KERNELS = {
    "w4_fast": None,
    "w4_gemv": functools.partial(w4_gemv.w4_gemv_linear, atomic=False),  # split K summed in a fixed order
    "w4_gemv_atomic": functools.partial(w4_gemv.w4_gemv_linear, atomic=True),  # split K by fp32 atomics
    # one row in fp16 pairs on a GPU (split K by atomics); more rows, or off CUDA: w4_gemv_atomic
    "w4_gemv_h2": w4_gemv_h2.w4_gemv_h2_linear,
    # the same with its splits summed after the launch (zeroed fp32 output, kernel, cast): the baseline that
    # `bench quant --variants awq@w4_gemv_h2_3launch,awq` times the in-launch sum against in one process
    "w4_gemv_h2_3launch": functools.partial(w4_gemv_h2.w4_gemv_h2_linear, in_launch=False),
}
# the GEMV, not w4_fast's tensor-core tiles, for small row counts: at one row reading the int4 words is the whole
# cost, which a multiply-and-sum streams at a larger share of the bandwidth (BENCHMARKS.md, W4A16 decode GEMVs).
# The atomic split-K sum is the faster one; its fp32 sums vary in the last bits from run to run. One row in fp16
# pairs (half the instructions a weight) made the AWQ batch-1 step 4% shorter than the atomic GEMV alone
DECODE_KERNEL = "w4_gemv_h2"
DECODE_MAX_ROWS = 4


def w4_packed_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    decode = DECODE_KERNELS[DECODE_KERNEL]
    if decode is not None and 0 < x.numel() // x.shape[-1] <= min(DECODE_MAX_ROWS, w4_gemv.MAX_ROWS):
        return decode(x, p, bias)
    return w4_fast.w4_packed_linear(x, p, bias)
