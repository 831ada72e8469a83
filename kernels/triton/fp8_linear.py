"""FP8 (e4m3) matmul on FP8 tensor cores: activations quantized per token on the fly (fp8_quant.py), weights
per output channel, both scales applied by ``torch._scaled_mm``'s row-wise scaling (cuBLASLt), bf16 out. A
float32 model gets float32 out (unit scales in the matmul, both applied after it): rounding every projection
to bf16 would be a second, larger error than the fp8 one it asked for.

Compute capability >= 8.9 is
checked before a model loads (shared/engine/quant/config.py); shapes cuBLASLt's FP8 path refuses (K or N
not a multiple of 16) take the dequantizing reference.
"""

import torch

from kvrelay.kernels import quant
from kvrelay.kernels.triton import skinny_linear
from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and weight.dtype == torch.float8_e4m3fn and x.shape[-1] % 16 == 0
            and weight.shape[0] % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if skinny_linear.supports_scaled(x, weight):
        # one row (batch-1 decode) is bound by reading the weight: a weight-only loop reads the same fp8
        # bytes without the per-token quantization launch and cuBLASLt's tile padding to 16+ rows
        return skinny_linear.scaled_linear(x, weight, scale, bias)
    if not supported(x, weight):
        return quant.fp8_linear(x, weight, scale, bias)
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    xq, x_scale = quantize_per_token_fp8(x2 if x2.stride(-1) == 1 else x2.contiguous())
    # weight [N, K] row-major is the column-major [K, N] operand cuBLASLt wants
    if x.dtype == torch.float32:
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y * x_scale * scale.view(1, n).float()  # [M, N] * [M, 1] * [1, N]
    else:
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, n).float(),
                             out_dtype=torch.bfloat16)
    if bias is not None:  # row-wise scaling takes no bias in every torch version: added here
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).view(*x.shape[:-1], n)
