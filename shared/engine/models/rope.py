"""Rotary-embedding cos/sin cache, computed exactly as HF transformers computes its inverse
frequencies (default, linear and llama3 scaling), laid out as kernels.rotary_embedding expects.

HF configs spell RoPE two ways: transformers < 5 writes ``rope_theta`` + ``rope_scaling``,
transformers >= 5 writes one ``rope_parameters`` dict; both are read.
"""

import math

import torch

from kvrelay.shared.engine.models.layers import cfg_get


def rope_parameters(hf_config: dict) -> dict:
    """One flat dict with ``rope_type``, ``rope_theta`` and the scaling keys, from either spelling."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params.update(scaling)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")  # pre-4.45 configs say "type"
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in hf_config:
        params["partial_rotary_factor"] = hf_config["partial_rotary_factor"]
    return params


def rotary_dim(hf_config: dict, head_dim: int) -> int:
    return int(head_dim * rope_parameters(hf_config).get("partial_rotary_factor", 1.0))


def inv_freq(hf_config: dict, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    # -> [rot_dim / 2] float32
    params = rope_parameters(hf_config)
    dim = rotary_dim(hf_config, head_dim)
    base = float(params["rope_theta"])
    # the exact HF expression: int64 arange cast to float, so the frequencies match bit for bit
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return freqs
    if rope_type == "linear":
        return freqs / params["factor"]
    if rope_type == "llama3":
        return _llama3_scale(freqs, params, hf_config)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3); "
        "'dynamic' NTK rescales by the running sequence length, which a shared paged cache cannot reproduce"
    )


def _llama3_scale(freqs: torch.Tensor, params: dict, hf_config: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings") or cfg_get(hf_config, "max_position_embeddings")
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    hf_config: dict, head_dim: int, max_positions: int, device: torch.device | str | None = None
) -> torch.Tensor:
    # -> [max_positions, rot_dim] = cat(cos, sin), float32: the kernels cast per use, and keeping
    # fp32 here avoids rounding the angle table to bf16 for every layer
    freqs = inv_freq(hf_config, head_dim, device)  # [rot_dim / 2]
    positions = torch.arange(max_positions, dtype=torch.float32, device=freqs.device)
    angles = positions[:, None] * freqs[None, :]  # [max_positions, rot_dim / 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
