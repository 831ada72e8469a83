"""What a model will cost in memory, read from its config and safetensors headers before anything loads:
the weights budget and each co-resident model's KV floor are checked against these."""

import math
from pathlib import Path

import torch

from kvrelay.shared.config.engine import EngineConfig


def estimate_weight_bytes(engine: EngineConfig, root: Path | None = None) -> int:
    """Weights in the dtype they will be loaded in, from the safetensors headers (or, for a dummy preset or
    a quantized model, its parameters on the meta device), without reading any tensor data. ``root``: the model
    repository its files must resolve inside (shared/engine/loader.py). A tensor- or pipeline-parallel group:
    what it counts against the weights budget (``group_weight_bytes``)."""
    if engine.tensor_parallel_size * engine.pipeline_parallel_size > 1:
        from kvrelay.shared.engine.ranks.checks import rank_weight_bytes

        return group_weight_bytes(rank_weight_bytes(engine, root), engine.device)
    from kvrelay.shared.engine.loader import read_safetensors_header, safetensors_files
    from kvrelay.shared.engine.models import build_model
    from kvrelay.shared.engine.quant.config import resolve

    device = torch.device(engine.device)
    dtype = engine.model.torch_dtype(device.type)
    config = _hf_config(engine, root)  # a folder without a config is not a model: fail before estimating
    dummy = engine.model.model.startswith("dummy:") or engine.model.load_format == "dummy"
    quant = None if engine.model.model.endswith(".gguf") else resolve(engine.model.quantization, config, device, dummy)
    if dummy or quant is not None:
        # the model's own parameters on the meta device: quantized projections count their packed
        # weights, scales and zero points, in whatever form the checkpoint stored them
        model = build_model(config, dtype, torch.device("meta"), quant)
        return sum(p.numel() * p.element_size() for p in model.parameters())
    path = Path(engine.model.model)
    if path.suffix == ".gguf":
        return path.stat().st_size * max(1, dtype.itemsize // 2)  # converted once; a rough upper bound
    numel = 0
    for f in safetensors_files(path, root):
        for name, meta in read_safetensors_header(f).items():
            if name != "__metadata__":
                numel += math.prod(meta["shape"])
    return numel * dtype.itemsize


def plan_weight_bytes(engine: EngineConfig, root: Path | None = None) -> tuple[int, list[int]]:
    """(what the model counts against the weights budget, each rank's shard: [] for a single-rank model). A
    tensor- or pipeline-parallel group is checked first: a size the model cannot split or more ranks than
    devices raise ValueError here, before any process starts or any weight loads."""
    if engine.tensor_parallel_size * engine.pipeline_parallel_size == 1:
        return estimate_weight_bytes(engine, root), []
    from kvrelay.shared.engine.ranks.checks import check_group, rank_weight_bytes

    check_group(engine, root)
    per_rank = rank_weight_bytes(engine, root)
    return group_weight_bytes(per_rank, engine.device), per_rank


def group_weight_bytes(per_rank: list[int], device: str) -> int:
    """What a group whose ranks hold ``per_rank`` bytes of weights counts against its worker's weights budget.

    The budget is per device (``--weights-memory``: the bytes of weights one device may hold). On CUDA each
    rank has a device of its own, counted from the worker's, so every model the worker hosts has a rank on
    the worker's device and that device is always the fullest: a group counts its largest shard, which is
    what it adds to that device at most, and a budget that holds the sum holds on every device of the group.
    On the CPU the ranks are processes in one host memory, which is the one "device": a group counts every
    shard (its whole weights)."""
    if not per_rank:
        return 0
    return max(per_rank) if device.startswith("cuda") else sum(per_rank)


def kv_floor_bytes(engine: EngineConfig, root: Path | None = None) -> int:
    """KV one sequence of the model's max length needs: the floor a co-resident model keeps."""
    from kvrelay.shared.repo.model_shape import max_model_len

    cfg = _hf_config(engine, root)
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or cfg.get("n_embd") or 0) // heads
    # a group's floor is rank 0's part of the shared pool: its own KV heads, its stage's layers (engine/kv_cache.py)
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    kv_heads = kv_heads // tp if kv_heads >= tp else 1
    layers = -(-layers // pp) if layers >= pp else layers  # stage 0 holds the most (parallel/pipeline.py)
    max_len = engine.model.max_model_len or max_model_len(cfg)
    bs = engine.cache.block_size
    from kvrelay.shared.engine.kv_dtype import kv_cache_dtype

    model_dtype = engine.model.torch_dtype(torch.device(engine.device).type)
    itemsize = kv_cache_dtype(engine.cache.kv_cache_dtype, model_dtype).itemsize  # fp8 KV: a byte a value
    return -(-max_len // bs) * layers * 2 * bs * kv_heads * head_dim * itemsize


def _hf_config(engine: EngineConfig, root: Path | None) -> dict:
    from kvrelay.shared.config.presets import get_preset
    from kvrelay.shared.engine.loader import read_hf_config

    if engine.model.model.startswith("dummy:"):
        return get_preset(engine.model.model.removeprefix("dummy:"))
    if engine.model.model.endswith(".gguf"):
        return {}
    return read_hf_config(Path(engine.model.model), root)
