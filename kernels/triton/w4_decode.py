"""Which kernel a W4 matmul over the repacked layout (kernels/w4_repack.py) runs, by row count: the one table
to change when the GPU's numbers say so (bench/quant_kernels.py, formats w4_fast and w4_gemv*).

``DECODE_KERNEL`` names the kernel for up to ``DECODE_MAX_ROWS`` rows (decode steps of a small batch); more
rows, and "w4_fast", take kernels/triton/w4_fast.py (tensor cores). Every entry reads the same weight
bytes: switching needs no change to the loading.
"""

import functools

import torch

from kvrelay.kernels.triton import w4_fast, w4_gemv
from kvrelay.kernels.w4_repack import W4Packed

DECODE_KERNELS = {
    "w4_fast": None,
    "w4_gemv": functools.partial(w4_gemv.w4_gemv_linear, atomic=False),  # split K summed in a fixed order
    "w4_gemv_atomic": functools.partial(w4_gemv.w4_gemv_linear, atomic=True),  # split K by fp32 atomics
}
# H100, 2026-12-05 (bench/quant_kernels.py, Llama-3-8B projections): one row 1.8-2.7x bf16 and 32-62% of the
# weight-read floor, against w4_fast's 0.85-1.24x and 17-29%; four rows 1.1-1.3x bf16, still ahead of w4_fast.
# The atomic split-K sum was 4-20% faster than the ordered one; its fp32 sums vary in the last bits run to run
DECODE_KERNEL = "w4_gemv_atomic"
DECODE_MAX_ROWS = 4


def w4_packed_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    decode = DECODE_KERNELS[DECODE_KERNEL]
    if decode is not None and 0 < x.numel() // x.shape[-1] <= min(DECODE_MAX_ROWS, w4_gemv.MAX_ROWS):
        return decode(x, p, bias)
    return w4_fast.w4_packed_linear(x, p, bias)
