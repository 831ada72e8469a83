"""Model registry: HF ``architectures[0]`` -> our implementation.

Every model takes ``(hf_config, dtype)`` and exposes ``num_layers``, ``num_kv_heads``,
``head_dim``, ``vocab_size`` (the runner sizes the KV cache from them), ``forward(input_ids,
positions, kv_caches, meta) -> hidden``, ``compute_logits(hidden) -> fp32 logits`` and
``load_weights(iterable of (HF name, tensor))``.
"""

from contextlib import nullcontext

import torch
from torch import nn

from kvrelay.shared.engine.models.bloom import BloomForCausalLM
from kvrelay.shared.engine.models.gpt2 import GPT2LMHeadModel
from kvrelay.shared.engine.models.layers import CausalLM
from kvrelay.shared.engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from kvrelay.shared.engine.parallel.pipeline import WHOLE, PipelineStage
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant.config import QuantConfig

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "BloomForCausalLM": BloomForCausalLM,
}

# configs written without "architectures" (some converters omit it) still name a model_type
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM"}


def get_model_class(hf_config: dict) -> type[CausalLM]:
    archs = hf_config.get("architectures") or []
    arch = archs[0] if archs else _BY_MODEL_TYPE.get(hf_config.get("model_type", ""))
    if arch not in MODEL_REGISTRY:
        named = arch or f"model_type {hf_config.get('model_type')!r}"
        raise ValueError(f"unsupported model architecture {named}; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]


def build_model(hf_config: dict, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None, quant: QuantConfig | None = None,
                parallel: ParallelState = SINGLE, stage: PipelineStage = WHOLE) -> nn.Module:
    """The model with uninitialised weights in ``dtype`` on ``device`` (default: torch's current
    default device; pass "meta" to size a model without allocating it); ``quant``: its decoder
    projections' quantization (shared/engine/quant/config.py); ``parallel``: the tensor-parallel group
    whose rank's shard this is (shared/engine/parallel/); ``stage``: the pipeline stage whose layers it holds."""
    with torch.device(device) if device is not None else nullcontext():
        return get_model_class(hf_config)(hf_config, dtype, quant, parallel, stage)


__all__ = ["MODEL_REGISTRY", "CausalLM", "build_model", "get_model_class",
           "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel", "BloomForCausalLM"]
