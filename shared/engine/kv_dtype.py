"""The KV cache's storage dtype (``--kv-cache-dtype``) and, for fp8, its per-layer scales.

``auto`` stores K/V in the model's dtype. ``fp8`` (= ``fp8_e4m3``, vLLM's names) stores float8_e4m3fn:
half the bytes of bf16, so the same memory holds twice the blocks. A layer stores ``x / scale`` and
reads ``stored * scale`` (kernels/kv_quant.py), one float32 scale for K and one for V per layer.

The scheme: the scales an FP8 checkpoint carries for its layers (shared/engine/kv_scales.py reads them
under vLLM's names), else 1.0, as vLLM does when there are none.
- Fixed for the cache's life: a block written under one scale and read under another is misread, and
  blocks outlive the requests that wrote them (prefix caching, swap, a handoff to another worker). A
  scale measured at the first write would be measured on whichever prompt came first and could never
  be corrected afterwards.
- The same on every worker without coordination: a prefill worker's blocks are read by a decode worker
  with nothing but the dtype, the model version and a digest of the scales to agree on (the handoff
  refuses a mismatch of any), and both read the same checkpoint's scales. A process whose weights are
  mapped from another (shared/worker/shared_weights.py) reads them from the checkpoint too: they are not
  weights.
- ``--calculate-kv-scales`` replaces both by scales measured on one fixed calibration batch at start,
  before any request writes a block (shared/engine/kv_calibration.py): still fixed for the cache's life,
  and the same in every process that runs the same batch through the same weights.
- 1.0 suffices: e4m3 spans 2^-9 .. 448 with 3 mantissa bits, so post-projection K and V (magnitudes
  from ~1e-2 to a few hundred in the models served here) keep ~6% relative precision per element,
  and values past ±448 clamp instead of becoming inf. A checkpoint calibrated its scales on real
  activations, so where it has them they are the better choice.
"""

import math
import re

import torch
from torch import nn

from kvrelay.kernels.kv_quant import FP8_KV_DTYPE

FP8_NAMES = ("fp8", "fp8_e4m3")
# A layer's KV scale in an FP8 checkpoint, by the names vLLM loads: ``self_attn.k_scale`` / ``v_scale``
# (llm-compressor, quark), ``k_proj.output_scale`` / ``v_proj.output_scale`` (older compressed-tensors),
# one ``kv_scale`` for both (AutoFP8). Group 1: the layer index; group 2: which.
KV_SCALE_NAME = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.(?:.*\.)?(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                           r"v_proj\.output_scale)$")


# --calculate-kv-scales divides a layer's measured amax by these, not by e4m3's 448: vLLM's constants
# (K_SCALE_CONSTANT, V_SCALE_CONSTANT), kept so the same flag means the same scales here. The batch measured is
# one fixed batch, and later prompts reach past its amax; what lies past 448 * scale clamps (an error without
# bound), while dividing by 200 rather than 448 costs only values below 2^-6 * scale a bit of precision (e4m3's
# relative precision is the same from 2^-6 to 448). V's constant is half K's, as in vLLM: twice the headroom.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


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


def kv_scale_entry(name: str, value: torch.Tensor) -> tuple[int, tuple[int, ...], float] | None:
    """(layer, which of K=0 / V=1 it sets, the scale) of a checkpoint tensor named as a KV scale, else None.
    A scale that is not one positive finite number is a corrupt checkpoint: one line naming the tensor."""
    match = KV_SCALE_NAME.search(name)
    if match is None:
        return None
    kind = match.group(2)
    which = (0, 1) if kind == "kv_scale" else (0,) if kind.startswith("k") else (1,)
    flat = value.float().reshape(-1)
    if flat.numel() != 1:
        raise ValueError(f"KV scale {name!r} has {flat.numel()} values: one scale per layer is supported "
                         "(not per head)")
    if not math.isfinite(scale := float(flat[0])) or scale <= 0:
        raise ValueError(f"KV scale {name!r} must be one positive finite number; the checkpoint has "
                         f"{flat.tolist()[:4]}")
    return int(match.group(1)), which, scale


def attach_kv_scales(model: nn.Module, device: torch.device,
                     checkpoint: list[list[float]] | None = None) -> torch.Tensor:
    """Give each decoder layer's attention its ``kv_scale`` ([2] float32: K, V) and return them all as
    ``[L, 2]``: ``checkpoint``'s ([layer][K, V] for every layer of the model, shared/engine/kv_scales.py), 1.0
    when it has none. Attention modules declare the attribute; the kernels read it only for an fp8 cache."""
    held = model.held_layers()  # a pipeline stage: its own layers, by their index in the whole model
    scales = torch.ones(len(held), 2, dtype=torch.float32)
    if checkpoint:
        scales = torch.tensor([checkpoint[index] for index, _ in held], dtype=torch.float32)
    scales = scales.to(device)
    for i, (_, layer) in enumerate(held):
        attn = next(m for m in layer.modules() if hasattr(m, "kv_scale"))
        attn.kv_scale = scales[i]
    return scales


def measure_kv_scale(kv_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``--calculate-kv-scales``: set one layer's ``kv_scale`` ([2] float32, in place, so a CUDA graph captured
    with it reads the new values) from the keys and values of a step about to be written (``k``, ``v``:
    [T, Hkv, D], keys after rotary, as the cache stores them): amax over the tokens the step stores (slot >= 0)
    and every head, over ``K_SCALE_RANGE`` / ``V_SCALE_RANGE``. A layer whose keys (or values) were all zero
    keeps 1.0: a zero scale would divide by zero at every later write."""
    keep = slot_mapping >= 0
    amax = torch.stack([k[keep].abs().amax(), v[keep].abs().amax()]).float()
    ranges = torch.tensor([K_SCALE_RANGE, V_SCALE_RANGE], dtype=torch.float32, device=amax.device)
    kv_scale.copy_(torch.where(amax > 0, amax / ranges, torch.ones_like(amax)))
