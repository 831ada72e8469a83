"""What a model will cost beside its weights and KV before it has been loaded here: its resident overhead and
its step peak (shared/engine/resident_memory.py measures both once it is loaded).

A model of a shape this worker has loaded before takes that shape's latest measurement (``CostMemo``); any
other an estimate from its config. The estimate counts what scales with the settings: the decode graphs'
logits and static inputs and the largest graph's intermediates (max_num_seqs rows of hidden, MLP and
vocabulary width), the rotary table; a step's activations (max_num_batched_tokens rows of one layer's widths,
the sampled rows' logits and the sampler's copies of them). ESTIMATE_MARGIN covers what it leaves out
(allocator rounding, library workspaces). The CPU has no graphs and holds no step peak back (the meter
measures none there), so it counts the rotary table and the KV scales, as the meter does.
"""

import json
from pathlib import Path

import torch

from kvrelay.shared.config.engine import EngineConfig

ESTIMATE_MARGIN = 1.5
SPLITS = 64  # the decode attention kernel's most splits of a long context: its partials scale with it


def _shape(engine: EngineConfig, root: Path | None) -> dict:
    from kvrelay.shared.repo.model_shape import max_model_len
    from kvrelay.shared.worker.model_memory import _hf_config

    cfg = _hf_config(engine, root)
    hidden = cfg.get("hidden_size") or cfg.get("n_embd") or 0
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 1
    return {"hidden": hidden, "heads": heads, "kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or hidden // heads, "vocab": cfg.get("vocab_size") or 0,
            "inter": cfg.get("intermediate_size") or 4 * hidden,
            "layers": cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0,
            "positions": cfg.get("max_position_embeddings") or 0, "max_len": max_model_len(cfg),
            "rotary": cfg.get("model_type") not in ("gpt2", "bloom")}  # learned positions, ALiBi: no table


def shape_key(engine: EngineConfig, root: Path | None) -> str:
    """What the measurement of one model stands for: its shape and the settings its graphs and steps scale
    with, not which weights it holds."""
    s, k = _shape(engine, root), engine.memory_knobs()
    return json.dumps([s, k.dtype, k.quantization, k.max_model_len, k.graph_mode, k.block_size, k.kv_cache_dtype,
                       k.max_num_seqs, k.max_num_batched_tokens, k.enable_chunked_prefill, k.device,
                       k.tensor_parallel_size, k.pipeline_parallel_size], sort_keys=True, default=str)


def estimate_costs(engine: EngineConfig, root: Path | None) -> tuple[int, int]:
    """(resident overhead, step peak) in bytes, from the config alone."""
    s, k = _shape(engine, root), engine.memory_knobs()
    device = torch.device(k.device)
    itemsize = k.torch_dtype().itemsize
    rotary = s["positions"] * s["head_dim"] * 4 if s["rotary"] else 0
    own = rotary + s["layers"] * 2 * 4  # the rotary table (fp32), the KV scales
    if device.type != "cuda":
        return own, 0
    max_len = k.max_model_len or s["max_len"]
    batch = k.max_num_seqs
    width = -(-max_len // k.block_size)
    qkv = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    graphs = (2 * batch * s["vocab"] * 4  # the static logits, and the graph's own before they are copied
              + batch * (4 + width) * 4  # the static inputs
              + batch * (4 * s["hidden"] + qkv + 3 * s["inter"]) * itemsize  # one layer's working set
              + batch * s["heads"] * SPLITS * (s["head_dim"] + 2) * 4)  # split attention partials
    layer = (4 * s["hidden"] + qkv + 3 * s["inter"]) * itemsize  # one layer's working set, a row
    # FULL_AND_PIECEWISE: the pieces' static buffers (residual, hidden, attention, qkv) and the graph pool keeping
    # the largest piece's working set; a family the pieces do not cover holds none, which this overcounts
    pieces = k.piecewise_tokens(max_len) * (4 + (2 * s["hidden"] + 2 * s["heads"] * s["head_dim"] + qkv) * itemsize
                                            + layer)
    overhead = own + (0 if k.graph_mode == "NONE" else graphs + pieces)
    tokens = k.step_tokens(max_len)  # its step's token budget as shared/engine/token_budget.py resolves it
    rows = min(tokens, batch)
    step = (tokens * (4 * s["hidden"] + qkv + 3 * s["inter"]) * itemsize + 3 * tokens * s["heads"] * s["head_dim"]
            * itemsize + 3 * rows * s["vocab"] * 4)  # activations, prompt attention, sampled logits and copies
    return int(overhead * ESTIMATE_MARGIN), int(step * ESTIMATE_MARGIN)


class CostMemo:
    """The latest measured (resident overhead, step peak) of each model shape this worker loaded."""

    def __init__(self) -> None:
        self._measured: dict[str, tuple[int, int]] = {}

    def costs(self, engine: EngineConfig, root: Path | None) -> tuple[int, int]:
        key = shape_key(engine, root)
        return self._measured[key] if key in self._measured else estimate_costs(engine, root)

    def note(self, engine: EngineConfig, root: Path | None, overhead: int, step_peak: int) -> None:
        self._measured[shape_key(engine, root)] = (overhead, step_peak)
