"""One row against an int8 / fp8 channel-scaled weight (kernels/quant.py's [N, K] and fp32 [N]) with the op
before it fused in: skinny_linear's NORM / ADD_NORM / SILU prologues over the 8-bit weight, so a quantized
batch-1 layer launches what a bf16 one does (no RMSNorm before qkv, no SiLU*mul before down, each a launch
and a round trip through memory that cost as much as its work). More rows, and weights wider than
skinny_linear's ``MAX_FEATURES`` (every program would recompute the norm), run the ops apart.
"""

import torch

from kvrelay.kernels.triton import skinny_linear
from kvrelay.kernels.triton.dequant_linear import int8_linear
from kvrelay.kernels.triton.fp8_linear import fp8_linear
from kvrelay.kernels.triton.rms_norm import rms_norm
from kvrelay.kernels.triton.silu_mul import silu_mul


def channel_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The registered matmul for the weight's type: W8A16 for int8, fp8's otherwise."""
    return (int8_linear if weight.dtype == torch.int8 else fp8_linear)(x, weight, scale, bias)


def _fuses(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return skinny_linear.supports_scaled(x, weight) and weight.shape[0] <= skinny_linear.MAX_FEATURES


def rms_norm_channel_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    fused = _fuses(x, weight) and norm_weight.dtype == x.dtype
    if residual is None:
        if fused:
            return skinny_linear.skinny_linear(x, weight, bias, prologue=skinny_linear.NORM, norm_weight=norm_weight,
                                               eps=eps, scale=scale), x
        return channel_linear(rms_norm(x, norm_weight, eps), weight, scale, bias), x
    if fused:
        return skinny_linear.skinny_linear(x, weight, bias, prologue=skinny_linear.ADD_NORM, residual=residual,
                                           norm_weight=norm_weight, eps=eps, scale=scale)
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return channel_linear(normed, weight, scale, bias), residual


def silu_mul_channel_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    if _fuses(x, weight):
        return skinny_linear.skinny_linear(x, weight, bias, prologue=skinny_linear.SILU, scale=scale)
    return channel_linear(silu_mul(x), weight, scale, bias)
