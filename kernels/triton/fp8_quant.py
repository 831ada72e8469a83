"""Per-token FP8 (e4m3) quantization of activations in one kernel: each program reads its row twice (the
row's largest magnitude, then the scaled values) and writes the fp8 row and its fp32 scale once. The torch
form of the same (kernels/quant.py) materializes fp32 copies of the whole activation several times, which
at prefill sizes (16k tokens x 14,336) costs more than the FP8 matmul saves."""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.quant import FP8_MAX


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cols < K)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (unit stride along K) -> (float8_e4m3fn [M, K], fp32 scale [M, 1]), as kernels/quant.py's."""
    assert FP8_MAX == 448.0
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _per_token_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return q, scale
