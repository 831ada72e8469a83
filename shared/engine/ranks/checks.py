"""Tensor- and pipeline-parallel mistakes found before anything loads: a size the ranks cannot split, more
stages than layers, a quantized model.

The model classes themselves compute every rank's share (through ``linear.even`` and ``kv_heads``), so
building the model on the meta device as rank 0 of the group raises exactly the error loading would,
without allocating a byte or starting a process.
"""

from pathlib import Path

import torch

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.config.presets import DUMMY_PREFIX, get_preset
from kvrelay.shared.engine.loader import read_hf_config
from kvrelay.shared.engine.models import build_model
from kvrelay.shared.engine.parallel.pipeline import config_layers, stage_bounds
from kvrelay.shared.engine.parallel.state import ParallelState


def check_tensor_parallel(hf_config: dict, world_size: int, quantized: bool) -> None:
    if world_size == 1:
        return
    if quantized:
        raise ValueError("tensor_parallel_size > 1 serves full-precision models only, not quantized ones")
    build_model(hf_config, torch.float32, "meta", parallel=ParallelState(0, world_size))


def check_pipeline_parallel(hf_config: dict, stages: int, quantized: bool) -> None:
    if stages == 1:
        return
    if quantized:
        raise ValueError("pipeline_parallel_size > 1 serves full-precision models only, not quantized ones")
    stage_bounds(config_layers(hf_config), stages)  # raises when a stage would hold no layers


def check_model(model_config: ModelConfig, world_size: int, root: Path | None = None, stages: int = 1) -> None:
    """``check_tensor_parallel`` and ``check_pipeline_parallel`` for the model a ModelConfig names (its
    config.json or dummy preset)."""
    name = model_config.model
    hf_config = (get_preset(name[len(DUMMY_PREFIX):]) if name.startswith(DUMMY_PREFIX)
                 else read_hf_config(Path(name), root))
    quantized = model_config.quantization is not None or hf_config.get("quantization_config") is not None
    check_tensor_parallel(hf_config, world_size, quantized)
    check_pipeline_parallel(hf_config, stages, quantized)
