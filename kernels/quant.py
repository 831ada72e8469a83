"""Quantized weights as the kernels read them, and the plain-torch reference matmuls over them.

Every checkpoint format converts to one of three layouts at load (shared/engine/quant/), so each kind of
kernel is written once:

- W4 (AWQ, GPTQ): ``qweight`` int32 [K/8, N], eight 4-bit values per word along the input dimension
  (nibble j of row r, low nibble first, is input k = 8r + j: GPTQ's own packing); ``zeros`` uint8
  [K/G, N] unpacked; ``scales`` fp16 [K/G, N]; ``g_idx`` int32 [K] (the group of each input, GPTQ's
  act-order) or None for k // G. ``w[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``. The
  loader interleaves the nibbles further per K tile (kernels/w4_repack.py; act-order's rows sorted into
  whole groups first) for the faster kernel, kernels/triton/w4_fast.py.
- int8 (W8A16): ``weight`` int8 [N, K], ``scale`` fp32 [N]: ``w[n, k] = q[n, k] * scale[n]``.
- fp8 (e4m3): ``weight`` float8_e4m3fn [N, K], ``scale`` fp32 [N], the same form. On CUDA with compute
  capability >= 8.9 activations are quantized per token on the fly and the matmul runs on FP8 tensor
  cores (kernels/triton/fp8_linear.py); the reference here dequantizes the weight only (W8A16), as vLLM does
  where FP8 tensor cores are absent. ``fp8_linear_w8a8`` is the tensor-core path's arithmetic in wider
  types, the reference its kernel and a whole fp8 model on the GPU are checked against.
"""

import torch
import torch.nn.functional as F

PACK = 8  # 4-bit values per int32 word
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> uint8-valued int32 [K, N] (values 0..15)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)  # [8]
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return q.reshape(-1, qweight.shape[1])


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [K, N] -> int32 [K/8, N], the inverse of ``unpack_w4``."""
    k, n = q.shape
    q = q.to(torch.int32).reshape(k // PACK, PACK, n)
    out = torch.zeros(k // PACK, n, dtype=torch.int32, device=q.device)
    for j in range(PACK):
        out |= q[:, j] << (4 * j)  # bit 31 set by nibble 7 is int32's sign bit: the same 32 bits
    return out


def w4_groups(k: int, group_size: int, g_idx: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The group of each of the K inputs, int64 [K]."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k, device=device) // group_size


def dequantize_w4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                  g_idx: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` (the product is formed in fp32, then rounded once)."""
    q = unpack_w4(qweight)  # [K, N]
    g = w4_groups(q.shape[0], group_size, g_idx, q.device)
    w = (q.float() - zeros[g].float()) * scales[g].float()  # [K, N]
    return w.t().to(dtype)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_w4(qweight, zeros, scales, group_size, g_idx, x.dtype), bias)


def dequantize_channel(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 or fp8 [N, K] times a per-output-channel fp32 scale [N] -> [N, K] in ``dtype``."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_channel(weight, scale, x.dtype), bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_channel(weight, scale, x.dtype), bias)


def fp8_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 as FP8 tensor cores compute it: x [..., K] rounded to e4m3 per token, weight [N, K] per channel."""
    xq, x_scale = quantize_per_token_fp8(x.reshape(-1, x.shape[-1]))
    x_deq = (xq.float() * x_scale).to(x.dtype).view(x.shape)
    return F.linear(x_deq, dequantize_channel(weight, scale, x.dtype), bias)


def quantize_channel(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a [N, K] weight: (int8 or fp8 [N, K], fp32 scale [N]).

    The scale maps each row's largest magnitude onto the format's largest value (127; 448 for e4m3).
    A zero row gets scale 1 so it dequantizes to zeros, not NaN."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    top = 127.0 if kind == "int8" else FP8_MAX
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    scaled = w / scale[:, None]
    if kind == "int8":
        return scaled.round().clamp(-127, 127).to(torch.int8), scale
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: [M, K] -> (fp8 [M, K], fp32 scale [M, 1]), one scale per row."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
