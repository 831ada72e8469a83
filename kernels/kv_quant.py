"""FP8 (e4m3) KV cache storage: how a K or V value is stored into a float8_e4m3fn cache and read back.

A layer's cache holds ``x / scale`` clamped to e4m3's finite range (±448) and rounded to nearest even;
a read is ``stored * scale``. ``kv_scale`` is a float32 tensor ``[2]`` per layer: the K scale, then the V
scale (shared/engine/kv_dtype.py chooses them). A cache of any other dtype stores values as they are and
ignores ``kv_scale``. The Triton kernels do the same on load (kernels/triton/*), never through a
dequantized copy of the cache.
"""

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` as float8_e4m3fn stored values under ``scale`` (a 0-d or broadcastable float32 tensor)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values as ``dtype``: fp8 ones times their scale (in float32, then rounded to ``dtype``)."""
    if not is_fp8(stored):
        return stored.to(dtype)
    out = stored.float()
    if scale is not None:
        out.mul_(scale)  # in place: the float copy is ours
    return out.to(dtype)


def scales(kv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(K scale, V scale) of one layer; (None, None) for scale 1."""
    return (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])


def dequantize_kv(keys: torch.Tensor, values: torch.Tensor, kv_scale: torch.Tensor | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cached keys and values as ``dtype``, each fp8 one times its own scale."""
    k_scale, v_scale = scales(kv_scale)
    return dequantize(keys, k_scale, dtype), dequantize(values, v_scale, dtype)


def as_cached(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's own keys and values as ``kv_cache`` gives them back (rounded through fp8 if it is fp8)."""
    if not is_fp8(kv_cache):
        return k, v
    k_scale, v_scale = scales(kv_scale)
    return round_trip(k, k_scale), round_trip(v, v_scale)


def round_trip(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as an fp8 cache would give it back: attention over a step's own K/V (not read through the
    cache) must see the same values as attention that reads them from the cache."""
    one = torch.ones((), dtype=torch.float32, device=x.device)
    s = one if scale is None else scale
    return dequantize(quantize(x, s), s, x.dtype)
