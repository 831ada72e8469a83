"""A copy of a tiny checkpoint with KV cache scale tensors added, as an FP8-KV-calibrated checkpoint carries
them (shared/engine/kv_scales.py names the forms), for the tests of fp8 KV caches that read them."""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def with_kv_scales(src: Path, dst: Path, scales: dict[str, float | list[float]]) -> Path:
    """``src`` copied to ``dst`` with each tensor ``name -> value`` of ``scales`` added to its weights."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors |= {name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def self_attn_scales(scales: dict[int, tuple[float, float]], layers: str = "model.layers",
                     attn: str = "self_attn") -> dict[str, float]:
    """``self_attn.k_scale`` / ``v_scale`` tensors (llm-compressor's names) of layer -> (K, V)."""
    return {f"{layers}.{layer}.{attn}.{kind}": value for layer, pair in scales.items()
            for kind, value in zip(("k_scale", "v_scale"), pair, strict=True)}
