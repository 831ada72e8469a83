"""EngineConfig.memory_knobs(): every knob a worker's memory estimate reads comes from its own setting."""

import dataclasses

import pytest
import torch

from kvrelay.shared.config.engine import (
    DEFAULT_STEP_TOKENS,
    CacheConfig,
    EngineConfig,
    MemoryKnobs,
    ModelConfig,
    SchedulerConfig,
)

# each knob: the section of EngineConfig holding its setting ("" for EngineConfig's own), the setting, and a value
# other than the default
SETTINGS = {
    "dtype": ("model", "dtype", "float16"),
    "quantization": ("model", "quantization", "int8"),
    "max_model_len": ("model", "max_model_len", 300),
    "graph_mode": ("model", "cudagraph_mode", "FULL_DECODE_ONLY"),
    "block_size": ("cache", "block_size", 32),
    "kv_cache_dtype": ("cache", "kv_cache_dtype", "fp8"),
    "max_num_seqs": ("scheduler", "max_num_seqs", 7),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens", 999),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill", False),
    "device": ("", "device", "cuda:1"),
    "tensor_parallel_size": ("", "tensor_parallel_size", 2),
    "pipeline_parallel_size": ("", "pipeline_parallel_size", 3),
}


def engine(section: str = "", name: str = "", value=None) -> EngineConfig:
    """A CUDA engine's settings (the CPU refuses --enforce-eager) with one setting changed; no device is needed to
    build them."""
    parts = {"model": {"model": "dummy:tiny-llama"}, "cache": {}, "scheduler": {}, "": {"device": "cuda:0"}}
    if name:
        parts[section][name] = value
    if name == "enable_chunked_prefill":  # a setting that only chunked prefill takes effect under
        parts["scheduler"]["max_prefill_tokens_with_decodes"] = 512
    return EngineConfig(model=ModelConfig(**parts["model"]), cache=CacheConfig(**parts["cache"]),
                        scheduler=SchedulerConfig(**parts["scheduler"]), **parts[""])


def test_every_knob_is_named_here():
    assert set(SETTINGS) == {f.name for f in dataclasses.fields(MemoryKnobs)}


@pytest.mark.parametrize("knob", sorted(SETTINGS))
def test_each_knob_follows_its_setting_alone(knob: str):
    base = engine().memory_knobs()
    changed = engine(*SETTINGS[knob]).memory_knobs()
    assert getattr(changed, knob) == SETTINGS[knob][2] != getattr(base, knob)
    assert dataclasses.replace(changed, **{knob: getattr(base, knob)}) == base


def test_the_step_tokens_resolve_as_the_engines_budget():
    assert engine().memory_knobs().step_tokens(4096) == DEFAULT_STEP_TOKENS
    assert engine("scheduler", "enable_chunked_prefill", False).memory_knobs().step_tokens(4096) == 4096
    assert engine("scheduler", "max_num_batched_tokens", 999).memory_knobs().step_tokens(4096) == 999


def test_the_dtype_resolves_on_the_knobs_device():
    assert engine().memory_knobs().torch_dtype() == torch.bfloat16
    assert engine("model", "dtype", "float16").memory_knobs().torch_dtype() == torch.float16
    cpu = EngineConfig(model=ModelConfig(model="dummy:tiny-llama"), device="cpu")
    assert cpu.memory_knobs().torch_dtype() == torch.float32 == cpu.model.torch_dtype("cpu")


def test_the_pieces_rows_follow_the_graph_mode_and_the_step_budget():
    assert engine().memory_knobs().piecewise_tokens(4096) == DEFAULT_STEP_TOKENS  # FULL_AND_PIECEWISE, the default
    assert engine("scheduler", "max_num_batched_tokens", 999).memory_knobs().piecewise_tokens(4096) == 999
    assert engine("scheduler", "max_num_batched_tokens", 8192).memory_knobs().piecewise_tokens(4096) == 2048
    assert engine("model", "cudagraph_mode", "FULL_DECODE_ONLY").memory_knobs().piecewise_tokens(4096) == 0
    eager = EngineConfig(model=ModelConfig(model="dummy:tiny-llama", enforce_eager=True, cudagraph_mode="NONE"),
                         device="cuda:0")
    assert eager.memory_knobs().graph_mode == "NONE" and eager.memory_knobs().piecewise_tokens(4096) == 0
