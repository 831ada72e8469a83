"""A full-precision HF checkpoint written out quantized, in the published layout each method's loaders
read (``kvrelay models import --quantization``, and the tests' quantized copies of real weights):

- ``fp8``: ``weight`` float8_e4m3fn plus a per-channel ``weight_scale`` [N, 1], as llm-compressor
  writes it (``quant_method`` compressed-tensors, float-quantized, channel strategy, dynamic tokens);
- ``int8``: ``weight`` int8 plus ``weight_scale`` [N, 1] (compressed-tensors naive-quantized W8A16);
- ``awq`` / ``gptq``: round-to-nearest 4-bit groups (formats.rtn_w4), no calibration, in AutoAWQ GEMM /
  GPTQ v1 packing.

The Llama family's decoder projections are quantized; embeddings, norms and the LM head stay as they are.
"""

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvrelay.kernels.quant import quantize_channel
from kvrelay.shared.engine.quant import formats

PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
METHODS = ("fp8", "int8", "awq", "gptq")


def quantization_config(method: str, group_size: int) -> dict:
    if method in ("awq", "gptq"):
        base = {"quant_method": method, "bits": 4, "group_size": group_size}
        return {**base, "zero_point": True, "version": "gemm"} if method == "awq" else \
            {**base, "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    weights = {"num_bits": 8, "type": "float" if method == "fp8" else "int", "strategy": "channel",
               "symmetric": True, "dynamic": False}
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors",
            "format": "float-quantized" if method == "fp8" else "naive-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations if method == "fp8" else None}},
            "ignore": ["lm_head"]}


def quantize_tensors(name: str, weight: torch.Tensor, method: str, group_size: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors replacing one projection's ``<prefix>.weight`` [N, K]."""
    prefix = name.removesuffix(".weight")
    if method in ("fp8", "int8"):
        q, scale = quantize_channel(weight, method)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale[:, None].contiguous()}
    q, zeros, scales = formats.rtn_w4(weight, group_size)
    packed = formats.to_awq(q, zeros, scales) if method == "awq" else formats.to_gptq(q, zeros, scales, group_size)
    return {f"{prefix}.{k}": v.contiguous() for k, v in packed.items()}


def quantize_checkpoint(src: Path, dst: Path, method: str, group_size: int = 128) -> Path:
    """Write ``src`` (config.json + safetensors) quantized with ``method`` into the new folder ``dst``."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is quantized already ({config['quantization_config'].get('quant_method')})")
    if config.get("model_type") not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"quantizing a checkpoint supports the Llama family; {src} is {config.get('model_type')!r}")
    dst.mkdir(parents=True)
    files = sorted(src.glob("*.safetensors"))
    weight_map: dict[str, str] = {}
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                out.update(quantize_tensors(name, tensor, method, group_size) if PROJECTION.match(name)
                           else {name: tensor})
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for other in sorted(src.iterdir()):  # tokenizer, generation config, chat template
        if other.is_file() and other.suffix != ".safetensors" and other.name not in ("config.json",
                                                                                    "model.safetensors.index.json"):
            shutil.copyfile(other, dst / other.name)
    config["quantization_config"] = quantization_config(method, group_size)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
