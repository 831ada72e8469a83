"""Which quantization a model runs with: ``--quantization`` (vLLM's names) and/or the checkpoint's
``quantization_config``, checked against each other and the device before anything loads.

Checkpoint formats read (``quant_method`` in config.json):
- ``awq``: AutoAWQ GEMM packing, 4 bits, with zero points;
- ``gptq``: AutoGPTQ / GPTQModel 4 bits, ``desc_act`` (act-order, ``g_idx``), sym or asym; the ``gptq``
  checkpoint format stores zero points minus one, ``gptq_v2`` stores them as they are;
- ``fp8``: weights float8_e4m3fn with a ``weight_scale`` per tensor (vLLM / AutoFP8);
- ``compressed-tensors`` whose weights are 8-bit floats (FP8) or unpacked symmetric 8-bit integers with
  16-bit activations (W8A16), per tensor or per channel (llm-compressor's formats); one with only a
  ``kv_cache_scheme`` quantizes no weights (its KV scales are the fp8 KV cache's).
Static activation scales (``input_scale``) are ignored: activations are always scaled per token.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where the device is asked: `kvrelay serve` checks configs without it
    import torch

METHODS = ("fp8", "int8", "awq", "gptq")
W4_METHODS = ("awq", "gptq")
DUMMY_GROUP_SIZE = 128  # random AWQ/GPTQ weights (load_format dummy) use the common group size


@dataclass(frozen=True)
class QuantConfig:
    method: str  # one of METHODS
    prequantized: bool  # weights arrive quantized (from the checkpoint); else quantized as they load
    group_size: int = DUMMY_GROUP_SIZE  # awq / gptq: inputs sharing one scale and zero point
    desc_act: bool = False  # gptq act-order: each input's group is read from g_idx
    zeros_minus_one: bool = True  # gptq format v1 stores zero points minus one

    @property
    def weight_bits(self) -> int:
        return 4 if self.method in W4_METHODS else 8


def from_checkpoint(hf_config: dict) -> QuantConfig | None:
    """The checkpoint's own quantization, or None for a full-precision checkpoint."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        if int(qc.get("bits", qc.get("w_bit", 4))) != 4:
            raise ValueError(f"quantization_config: awq with {qc.get('bits', qc.get('w_bit'))} bits; only 4 is supported")
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"quantization_config: awq version {qc.get('version')!r}; only the GEMM packing is supported")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config: awq without zero points is not supported")
        return QuantConfig("awq", True, _group_size(qc, "awq"))
    if method == "gptq":
        if int(qc.get("bits", 4)) != 4:
            raise ValueError(f"quantization_config: gptq with {qc.get('bits')} bits; only 4 is supported")
        v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return QuantConfig("gptq", True, _group_size(qc, "gptq"), bool(qc.get("desc_act", False)), not v2)
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError("quantization_config: fp8 with weight_block_size (block-wise FP8) is not supported")
        return QuantConfig("fp8", True)
    if method == "compressed-tensors":
        if not qc.get("config_groups") and qc.get("kv_cache_scheme"):
            return None  # the KV cache's scales alone (shared/engine/kv_scales.py), full-precision weights
        kinds = set()
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            kind = {"float": "fp8", "int": "int8"}.get(weights.get("type", ""))
            if kind is None or int(weights.get("num_bits", 0)) != 8 or not weights.get("symmetric", True) \
                    or weights.get("strategy", "tensor") not in ("tensor", "channel") \
                    or (kind == "int8" and (qc.get("format") != "naive-quantized" or group.get("input_activations"))):
                raise ValueError(f"quantization_config: compressed-tensors weights {weights}: supported are 8-bit "
                                 "float weights (FP8) and unpacked symmetric int8 weights with 16-bit activations "
                                 "(W8A16), per tensor or per channel")
            kinds.add(kind)
        if len(kinds) != 1:
            raise ValueError("quantization_config: compressed-tensors needs one weight type for every group")
        return QuantConfig(kinds.pop(), True)
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported "
                     f"(supported: awq, gptq, fp8, compressed-tensors fp8)")


def _group_size(qc: dict, method: str) -> int:
    size = int(qc.get("group_size", qc.get("q_group_size", DUMMY_GROUP_SIZE)))
    if size <= 0 or size % 8:
        raise ValueError(f"quantization_config: {method} group_size {size}; it must be a positive multiple of 8 "
                         "(per-channel, group_size -1, is not supported)")
    return size


def resolve(requested: str | None, hf_config: dict, device: "torch.device", dummy: bool = False) -> QuantConfig | None:
    """The quantization to run, from ``--quantization`` (None: the checkpoint's) and the checkpoint's
    config; raises ValueError with one line when they disagree or the device cannot run it."""
    chosen = choose(requested, hf_config, dummy)
    if chosen is not None and chosen.method == "fp8" and device.type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"quantization fp8 needs compute capability >= 8.9 (Ada, Hopper); this GPU is "
                             f"{major}.{minor}: use int8, awq or gptq")
    return chosen


def choose(requested: str | None, hf_config: dict, dummy: bool = False) -> QuantConfig | None:
    """``resolve`` without the device: what the flag and the checkpoint's config say together."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {requested!r}")
    found = None if dummy else from_checkpoint(hf_config)
    if found is not None and requested is not None and requested != found.method:
        raise ValueError(f"quantization {requested} does not match the checkpoint, which is quantized with "
                         f"{found.method} (its config.json quantization_config); leave --quantization unset")
    if found is None and requested in W4_METHODS and not dummy:
        raise ValueError(f"quantization {requested} needs a checkpoint quantized with {requested} (config.json "
                         f"quantization_config.quant_method {requested}); to quantize a full-precision model as "
                         "it loads, use fp8 or int8")
    return found or (QuantConfig(requested, prequantized=dummy) if requested else None)
