"""The KV cache's storage dtype (``--kv-cache-dtype``) and, for fp8, its per-layer scales.

``auto`` stores K/V in the model's dtype. ``fp8`` (= ``fp8_e4m3``, vLLM's names) stores float8_e4m3fn:
half the bytes of bf16, so the same memory holds twice the blocks. A layer stores ``x / scale`` and
reads ``stored * scale`` (kernels/kv_quant.py), one float32 scale for K and one for V per layer.

The scheme: every scale is 1.0, fixed, as vLLM's default when a checkpoint carries no KV scales.
- Fixed for the cache's life: a block written under one scale and read under another is misread, and
  blocks outlive the requests that wrote them (prefix caching, swap, a handoff to another worker). A
  scale measured at the first write would be measured on whichever prompt came first and could never
  be corrected afterwards.
- The same on every worker without coordination: a prefill worker's blocks are read by a decode worker
  with nothing but the dtype to agree on (the handoff refuses a dtype mismatch).
- 1.0 suffices: e4m3 spans 2^-9 .. 448 with 3 mantissa bits, so post-projection K and V (magnitudes
  from ~1e-2 to a few hundred in the models served here) keep ~6% relative precision per element,
  and values past ±448 clamp instead of becoming inf. The scales live in a per-layer tensor that every
  kernel reads, so checkpoint-provided scales can replace the ones here without touching a kernel.
"""

import torch
from torch import nn

from kvrelay.kernels.kv_quant import FP8_KV_DTYPE

FP8_NAMES = ("fp8", "fp8_e4m3")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype ``--kv-cache-dtype name`` stores for a model computing in ``model_dtype``."""
    if name == "auto":
        return model_dtype
    if name in FP8_NAMES:
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype: unknown value {name!r} (auto, fp8, fp8_e4m3)")


def check_device(name: str, device: torch.device) -> None:
    """Before any weight loads: the Triton kernels convert float8_e4m3fn in hardware, which CUDA GPUs
    below compute capability 8.9 (Ada, Hopper) do not have. One line, naming the flag."""
    if name in FP8_NAMES and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype {name} needs compute capability >= 8.9 (Ada, Hopper); this GPU is "
                             f"{major}.{minor}: use --kv-cache-dtype auto")


def attach_kv_scales(model: nn.Module, device: torch.device) -> torch.Tensor:
    """Give each decoder layer's attention its ``kv_scale`` ([2] float32: K, V) and return them all as
    ``[L, 2]``. Attention modules declare the attribute; the kernels read it only for an fp8 cache."""
    layers = [layer for _, layer in model.held_layers()]  # a pipeline stage: its own layers
    scales = torch.ones(len(layers), 2, dtype=torch.float32, device=device)
    for i, layer in enumerate(layers):
        attn = next(m for m in layer.modules() if hasattr(m, "kv_scale"))
        attn.kv_scale = scales[i]
    return scales
