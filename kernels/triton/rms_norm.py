"""Fused RMSNorm with an optional residual add: one read of x (and residual), one write of each output."""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.utils import pow2, row_warps, rows_view


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # round the sum to the residual stream's dtype first, as torch's `x + residual` does
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # the reference rounds the normalised row to x's dtype before the weight multiply
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [..., H]; weight: [H]. Returns out, or (out, x + residual) with fresh tensors.
    hidden = x.shape[-1]
    x2 = rows_view(x)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    r2 = rows_view(residual) if residual is not None else x2
    res_out = torch.empty(x2.shape, dtype=sum_dtype, device=x.device) if residual is not None else out
    if x2.shape[0]:
        block = pow2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=row_warps(block),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
