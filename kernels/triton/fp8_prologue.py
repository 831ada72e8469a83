"""The ops before an FP8 matmul that also quantize what they produce: RMSNorm (after the residual add) and
SiLU(gate) * up, each writing its row as e4m3 with the row's fp32 scale instead of in the model's dtype.

At prefill the per-token quantization (kernels/triton/fp8_quant.py) is a pass of its own over every
projection's input: the norm or SiLU*mul writes a bf16 row, the quantization reads it back and writes it
again in fp8. Here the row stays in registers between the two, so each projection's input is written once,
at a byte an element. Each value is rounded as the unfused ops round it (the norm or product rounded to
the model's dtype, then scaled by the row's largest magnitude over 448 and rounded to nearest even), so the
fp8 bytes and scales equal those of the two kernels run one after the other.

One program a row, the whole row in registers: ``MAX_COLS`` bounds it (a wider row takes the unfused ops).
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.quant import FP8_MAX
from kvrelay.kernels.triton.utils import pow2, row_warps, rows_view

MAX_COLS = 32768  # 64 fp32 values a thread at 16 warps


@triton.jit
def _store_fp8_row(v, q_ptr, s_ptr, row, cols, mask, K):
    # v: the row in fp32 (values of the model's dtype), masked columns 0
    scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    q = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, stride_x, stride_r, stride_ro, K, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:  # the sum rounded to the stream's dtype before the norm, as torch's `x + residual`
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
             ).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
    _store_fp8_row(normed, q_ptr, s_ptr, row, cols, mask, K)


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + K + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    _store_fp8_row((act * up.to(tl.float32)).to(gate.dtype).to(tl.float32), q_ptr, s_ptr, row, cols, mask, K)


def fits(x: torch.Tensor, cols: int) -> bool:
    """Whether a row of ``cols`` outputs of ``x``'s dtype takes these kernels."""
    return x.dtype in (torch.float16, torch.bfloat16) and 0 < cols <= MAX_COLS


def _outputs(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    assert FP8_MAX == 448.0
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [..., K] (one dtype, ``weight`` [K] too) -> (e4m3 [R, K], fp32 scale [R, 1], the residual
    stream: x + residual, or x itself without one)."""
    k = x.shape[-1]
    x2 = rows_view(x)
    q, scale = _outputs(x2.shape[0], k, x.device)
    r2 = rows_view(residual) if residual is not None else x2
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else x2
    if x2.shape[0]:
        block = pow2(k)
        _rms_norm_fp8_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), q, scale, res_out, x2.stride(0), r2.stride(0),
                                             res_out.stride(0), k, eps, HAS_RES=residual is not None, BLOCK=block,
                                             num_warps=row_warps(block))
    return q, scale, (x if residual is None else res_out.view(x.shape))


def silu_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2K] (gate | up) -> (SiLU(gate) * up as e4m3 [R, K], fp32 scale [R, 1])."""
    k = x.shape[-1] // 2
    x2 = rows_view(x)
    q, scale = _outputs(x2.shape[0], k, x.device)
    if x2.shape[0]:
        block = pow2(k)
        _silu_mul_fp8_kernel[(x2.shape[0],)](x2, q, scale, x2.stride(0), k, BLOCK=block, num_warps=row_warps(block))
    return q, scale
