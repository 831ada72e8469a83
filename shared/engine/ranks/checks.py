"""Tensor- and pipeline-parallel mistakes found before anything loads: a size the ranks cannot split, more
stages than layers, more ranks than devices, a quantization the ranks cannot split; and
what each rank's shard weighs.

The model classes themselves compute every rank's share (through ``linear.even`` and ``kv_heads``), so
building the model on the meta device as rank 0 of the group raises exactly the error loading would,
without allocating a byte or starting a process. The same meta build of each rank sizes its shard.
"""

from pathlib import Path

import torch

from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.config.presets import DUMMY_PREFIX, get_preset
from kvrelay.shared.engine.loader import check_split_quantization, read_hf_config
from kvrelay.shared.engine.models import build_model
from kvrelay.shared.engine.parallel.layout import RankLayout
from kvrelay.shared.engine.parallel.pipeline import config_layers, make_stage, stage_bounds
from kvrelay.shared.engine.parallel.state import ParallelState
from kvrelay.shared.engine.quant import config as quant_config
from kvrelay.shared.engine.quant.config import QuantConfig


def check_tensor_parallel(hf_config: dict, world_size: int, quant: QuantConfig | None = None) -> None:
    if world_size == 1:
        return
    if quant is not None:
        check_split_quantization(quant, world_size)
    # quantized too: its layers' own checks apply (a 4-bit group size that does not divide a shard's inputs)
    build_model(hf_config, torch.float32, "meta", quant, parallel=ParallelState(0, world_size))


def check_pipeline_parallel(hf_config: dict, stages: int) -> None:
    if stages == 1:
        return
    stage_bounds(config_layers(hf_config), stages)  # raises when a stage would hold no layers


def _quant(model_config: ModelConfig, hf_config: dict) -> QuantConfig | None:
    """The quantization the model loads with (the flag, or its checkpoint's), as the loader resolves it."""
    dummy = model_config.load_format == "dummy" or model_config.model.startswith(DUMMY_PREFIX)
    return quant_config.choose(model_config.quantization, hf_config, dummy)


def _hf_config(model_config: ModelConfig, root: Path | None) -> dict:
    name = model_config.model
    return (get_preset(name[len(DUMMY_PREFIX):]) if name.startswith(DUMMY_PREFIX)
            else read_hf_config(Path(name), root))


def check_model(model_config: ModelConfig, world_size: int, root: Path | None = None, stages: int = 1) -> None:
    """``check_tensor_parallel`` and ``check_pipeline_parallel`` for the model a ModelConfig names (its
    config.json or dummy preset)."""
    hf_config = _hf_config(model_config, root)
    check_tensor_parallel(hf_config, world_size, _quant(model_config, hf_config))
    check_pipeline_parallel(hf_config, stages)


def group_size_name(config: EngineConfig) -> str:
    """The setting(s) that make the group, as an error names them."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return f"tensor_parallel_size {tp}"
    return f"pipeline_parallel_size {pp}" if tp == 1 else f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"


def check_devices(config: EngineConfig) -> None:
    """CUDA: rank r runs on the r-th device counted from the configured one, so the group needs that many.
    (On the CPU every rank is a process on the same host memory: nothing to count.)"""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if world > 1 and config.device.startswith("cuda"):
        first, have = torch.device(config.device).index or 0, torch.cuda.device_count()
        if first + world > have:
            raise ValueError(f"{group_size_name(config)} needs CUDA devices {first}..{first + world - 1}; "
                             f"this machine has {have}")


def check_group(config: EngineConfig, root: Path | None = None) -> None:
    """Every check a group's settings and model must pass before a process starts or a weight loads."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return
    # the model's split first: a size it cannot split is wrong on any machine, a device count only on this one
    check_model(config.model, config.tensor_parallel_size, root, config.pipeline_parallel_size)
    check_devices(config)


def rank_weight_bytes(config: EngineConfig, root: Path | None = None) -> list[int]:
    """The bytes of weights each rank of the group holds (rank order), in the dtype they load in: its model
    built on the meta device with its tensor-parallel shard and its pipeline stage, as the rank builds it."""
    hf_config = _hf_config(config.model, root)
    quant = _quant(config.model, hf_config)  # a quantized shard weighs its quantized bytes
    dtype = config.model.torch_dtype(torch.device(config.device).type)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    sizes = []
    for rank in range(tp * pp):
        at = RankLayout(rank, tp, pp)
        model = build_model(hf_config, dtype, "meta", quant, parallel=ParallelState(at.tp_rank, tp),
                            stage=make_stage(at.stage, pp, hf_config))
        sizes.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    return sizes
