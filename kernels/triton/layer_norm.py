"""LayerNorm over the last dim in fp32, output in x's dtype (GPT-2 / BLOOM blocks)."""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.utils import pow2, row_warps, rows_view


@triton.jit
def _layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)  # biased variance, as torch
    y = centered * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # x: [..., H]; weight, bias: [H] or None
    hidden = x.shape[-1]
    x2 = rows_view(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = pow2(hidden)
        w = weight.contiguous() if weight is not None else x2
        b = bias.contiguous() if bias is not None else x2
        _layer_norm_kernel[(x2.shape[0],)](
            x2, w, b, out, x2.stride(0), out.stride(0), hidden, eps,
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block, num_warps=row_warps(block),
        )
    return out.view(x.shape)
