"""KV blocks leaving or entering a tensor- or pipeline-parallel group as full tensors (every layer, every
KV head), through rank 0: the import of KV handed over by another worker, and the export of a whole copy
(shared/engine/parallel/kv_heads.py regroups the heads).

Every rank runs the same function for the same message (rank 0 after sending it, ranks 1..N-1 on
receiving it), so the collective inside lines up like a step's. It runs over the whole group: under a
pipeline each stage's ranks hold their own layers (and, with TP within the stage, their own heads of
them), so an export gathers every rank's part of the blocks to rank 0, which regroups the heads of each
stage and stacks the stages' layers in order; an import cuts rank 0's full tensor the same way and
scatters each rank its part. Both move every layer at once, between steps; a model's per-layer hooks run
inside the forward, where no other collective may interleave, so a sharded group's KV never moves
layer by layer.

A prefill worker's handoff does not export: each rank sends its own part to the decode worker itself
(kv_parts.py), and rank 0 keeps only the transfer's control. The export stays for an engine without the
links its ranks would dial with (the offline API, tests reading a whole copy back). Likewise a sharded decode
worker's ranks each take their own share of KV its sender's ranks (or a one-rank sender) send (kv_inlet.py); the
import here is for KV that arrives whole at rank 0 (frames, before every rank said where it listens, or from a
sender without links), staged and scattered, one hop over the group's links.
"""

import torch

from kvrelay.kernels.kv_quant import FP8_KV_DTYPE
from kvrelay.shared.engine.parallel.kv_heads import merge_heads, split_heads
from kvrelay.shared.engine.parallel.pipeline import stage_bounds
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.ranks.group import RankGroup
from kvrelay.shared.wire.rank_step import RankKVExport, RankKVImport

LAYER_DIM = 0  # a KV cache is [L, 2, N, bs, Hkv, D]


def total_kv_heads(model) -> int:
    """The model's KV heads over the whole group (GPT-2 and BLOOM have one per attention head)."""
    return getattr(model, "total_num_kv_heads", None) or model.total_num_heads


def stage_layers(model) -> list[tuple[int, int]]:
    """[start, end) of every pipeline stage's layers (one stage, all of them, without a pipeline)."""
    return stage_bounds(model.num_layers, model.stage.size)


def check_block_ids(kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """Rank 0 checks before any rank indexes: a bad id on a rank would take the group down."""
    if not block_ids or not 0 <= min(block_ids) <= max(block_ids) < kv_cache.shape[2]:
        raise ValueError("KV block id out of range")


def _padded(t: torch.Tensor, layers: int) -> torch.Tensor:
    """``t`` with zero layers appended up to ``layers``: a collective moves tensors of one shape, and stages
    may hold a layer more than others."""
    if t.shape[LAYER_DIM] == layers:
        return t
    return torch.cat([t, t.new_zeros((layers - t.shape[LAYER_DIM],) + t.shape[1:])], dim=LAYER_DIM)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes: moved as they are (gloo has no float8 type), under the scales both sides
    read from the same checkpoint."""
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t


def export_blocks(state: ParallelState, kv_cache: torch.Tensor, block_ids: list[int], num_kv_heads: int,
                  stages: list[tuple[int, int]]) -> torch.Tensor | None:
    """``[L, 2, n, bs, num_kv_heads, D]``: every rank's part of ``block_ids`` on rank 0 (None elsewhere).
    ``state``: the whole group, ranks in stage order (parallel/layout.py); ``stages``: ``stage_layers``."""
    if kv_cache.dtype == FP8_KV_DTYPE:
        full = export_blocks(state, _as_bytes(kv_cache), block_ids, num_kv_heads, stages)
        return None if full is None else full.view(FP8_KV_DTYPE)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    longest = max(end - start for start, end in stages)
    parts = state.gather_to_driver(_padded(kv_cache.index_select(2, index), longest))
    if parts is None:
        return None
    tp = len(parts) // len(stages)
    layers = [merge_heads(parts[s * tp:(s + 1) * tp], num_kv_heads).narrow(LAYER_DIM, 0, end - start)
              for s, (start, end) in enumerate(stages)]
    return layers[0] if len(layers) == 1 else torch.cat(layers, dim=LAYER_DIM)


def import_blocks(state: ParallelState, kv_cache: torch.Tensor, block_ids: list[int], full: torch.Tensor | None,
                  stages: list[tuple[int, int]]) -> None:
    """Write this rank's part of ``full`` (rank 0's ``[L, 2, n, bs, Hkv, D]``; None elsewhere): its
    stage's layers, its heads of them, into ``block_ids`` of its cache."""
    if kv_cache.dtype == FP8_KV_DTYPE:
        import_blocks(state, _as_bytes(kv_cache), block_ids, None if full is None else _as_bytes(full), stages)
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    longest = max(end - start for start, end in stages)
    mine = kv_cache.new_empty((longest,) + kv_cache.shape[1:2] + (len(block_ids),) + kv_cache.shape[3:])
    parts = None
    if full is not None:
        full = full.to(kv_cache.device)
        tp = state.world_size // len(stages)
        parts = [_padded(heads, longest) for start, end in stages
                 for heads in split_heads(full.narrow(LAYER_DIM, start, end - start), tp)]
    state.scatter_from_driver(parts, mine)
    kv_cache.index_copy_(2, index, mine.narrow(LAYER_DIM, 0, kv_cache.shape[LAYER_DIM]))


def driver_export(ranks: RankGroup | None, kv_cache: torch.Tensor, block_ids: list[int], num_kv_heads: int,
                  stages: list[tuple[int, int]]) -> torch.Tensor:
    """Rank 0: ``export_blocks`` with every rank, stages included (a copy of the blocks without parallelism)."""
    check_block_ids(kv_cache, block_ids)
    if ranks is None:
        return export_blocks(SINGLE, kv_cache, block_ids, num_kv_heads, stages)
    ranks.send(RankKVExport(list(block_ids)))
    try:
        return export_blocks(ranks.state, kv_cache, block_ids, num_kv_heads, stages)
    except RuntimeError as exc:  # the gather broke: a rank died
        raise ranks.down(exc) from exc


def driver_import(ranks: RankGroup | None, kv_cache: torch.Tensor, block_ids: list[int], full: torch.Tensor,
                  stages: list[tuple[int, int]]) -> None:
    """Rank 0: ``import_blocks`` with every rank, stages included."""
    check_block_ids(kv_cache, block_ids)
    if full.shape[LAYER_DIM] != stages[-1][1]:
        raise ValueError(f"KV of {full.shape[LAYER_DIM]} layers for a model of {stages[-1][1]}")
    if full.dtype != kv_cache.dtype:  # fp8 bytes under the wrong dtype would be read as other values
        raise ValueError(f"KV of dtype {full.dtype} for a cache of {kv_cache.dtype}")
    if ranks is None:
        import_blocks(SINGLE, kv_cache, block_ids, full, stages)
        return
    ranks.send(RankKVImport(list(block_ids)))
    try:
        import_blocks(ranks.state, kv_cache, block_ids, full, stages)
    except RuntimeError as exc:  # the scatter broke: a rank died
        raise ranks.down(exc) from exc
