"""A GPTQ act-order checkpoint of a tiny Llama, and the fp32 checkpoint of the same weights dequantized."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvrelay.kernels import quant as kq
from kvrelay.shared.engine.quant import formats
from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint


def write_act_order_gptq(src: Path, dst: Path, group: int) -> tuple[Path, Path]:
    """(the act-order checkpoint, its dequantized twin) under ``dst``: every input's group read from a
    shuffled g_idx, the same per input size, as the fused q|k|v and gate|up parts must share theirs."""
    ckpt, deq = quantize_checkpoint(src, dst / "gptq", "gptq", group_size=group), dst / "deq"
    shutil.copytree(src, deq)
    tensors, reference = load_file(str(ckpt / "model.safetensors")), load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".g_idx")]:
        k = tensors[name].numel()
        tensors[name] = (torch.randperm(k, generator=torch.Generator().manual_seed(k)) // group).to(torch.int32)
        prefix = name.removesuffix(".g_idx")
        zeros = formats.gptq_qzeros_to_w4(tensors[f"{prefix}.qzeros"], minus_one=True)
        reference[f"{prefix}.weight"] = kq.dequantize_w4(tensors[f"{prefix}.qweight"], zeros,
                                                         tensors[f"{prefix}.scales"], group, tensors[name]).contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(deq / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt, deq
