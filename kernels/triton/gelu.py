"""GELU, tanh-approximate (GPT-2, Gemma) or exact erf ("none", BLOOM-style MLPs), computed in fp32."""

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if EXACT:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi) * (x + 0.044715 x^3)
        # tanh(z) = 1 - 2 / (exp(2z) + 1): saturates to +-1 without inf/inf when exp overflows
        y = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _gelu_kernel[(triton.cdiv(n, _BLOCK),)](xc, out, n, EXACT=approximate == "none", BLOCK=_BLOCK, num_warps=8)
    return out.view(x.shape)
