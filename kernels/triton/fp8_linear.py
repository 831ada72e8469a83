"""FP8 (e4m3) matmul on FP8 tensor cores: activations quantized per token on the fly (fp8_quant.py), weights
per output channel, both scales applied by ``torch._scaled_mm``'s row-wise scaling (cuBLASLt), bf16 out. A
float32 model gets float32 out (unit scales in the matmul, both applied after it): rounding every projection
to bf16 would be a second, larger error than the fp8 one it asked for.

Compute capability >= 8.9 is
checked before a model loads (shared/engine/quant/config.py); shapes cuBLASLt's FP8 path refuses (K or N
not a multiple of 16) take the dequantizing reference.

``PREFILL_GEMM``: who multiplies prefill-sized rows. "cublaslt" (``torch._scaled_mm``) or "triton"
(kernels/triton/fp8_gemm.py, both scales in its epilogue); ``bench quant --variants fp8,fp8@triton`` compares them.
"""

import torch

from kvrelay.kernels import quant
from kvrelay.kernels.triton import fp8_gemm, fp8_prologue, skinny_linear
from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8
from kvrelay.kernels.triton.rms_norm import rms_norm
from kvrelay.kernels.triton.silu_mul import silu_mul

PREFILL_GEMM = "cublaslt"


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
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_per_token_fp8(x2 if x2.stride(-1) == 1 else x2.contiguous())
    return scaled_mm(xq, x_scale, weight, scale, bias, x.dtype).view(*x.shape[:-1], weight.shape[0])


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 rows xq [M, K] with their fp32 scales [M, 1] @ the e4m3 weight [N, K] (scales [N]) -> [M, N] in ``dtype``."""
    n = weight.shape[0]
    # weight [N, K] row-major is the column-major [K, N] operand cuBLASLt wants
    if dtype == torch.float32:
        one = torch.ones((), device=xq.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y * x_scale * scale.view(1, n).float()  # [M, N] * [M, 1] * [1, N]
    elif PREFILL_GEMM == "triton" and fp8_gemm.fits(xq, weight):
        y = fp8_gemm.fp8_gemm(xq, x_scale, weight, scale, dtype)
    else:
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, n).float(),
                             out_dtype=torch.bfloat16)
    if bias is not None:  # row-wise scaling takes no bias in every torch version: added here
        y = y + bias.to(y.dtype)
    return y.to(dtype)


# -- with the op before the matmul quantizing its own output (kernels/triton/fp8_prologue.py) -------------
def _prologue_fits(x: torch.Tensor, weight: torch.Tensor, cols: int) -> bool:
    # one row keeps the weight-only loop (no activation quantization to fuse); fp32 models keep the unfused ops
    return (not skinny_linear.supports_scaled(x, weight) and fp8_prologue.fits(x, cols) and weight.shape[1] == cols
            and supported(x[..., :cols], weight))


def rms_norm_fp8_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_linear(rms_norm(x [+ residual])), the residual stream), the norm writing e4m3 rows for the matmul."""
    k = x.shape[-1]
    same = norm_weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    if not (same and _prologue_fits(x, weight, k)):
        if residual is None:
            return fp8_linear(rms_norm(x, norm_weight, eps), weight, scale, bias), x
        normed, residual = rms_norm(x, norm_weight, eps, residual)
        return fp8_linear(normed, weight, scale, bias), residual
    xq, x_scale, residual = fp8_prologue.rms_norm_fp8(x, norm_weight, eps, residual)
    return scaled_mm(xq, x_scale, weight, scale, bias, x.dtype).view(*x.shape[:-1], weight.shape[0]), residual


def silu_mul_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear(SiLU(gate) * up) of x = gate | up, the product written as e4m3 rows for the matmul."""
    k = x.shape[-1] // 2
    if not _prologue_fits(x, weight, k):
        return fp8_linear(silu_mul(x), weight, scale, bias)
    xq, x_scale = fp8_prologue.silu_mul_fp8(x)
    return scaled_mm(xq, x_scale, weight, scale, bias, x.dtype).view(*x.shape[:-1], weight.shape[0])
