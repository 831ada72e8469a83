"""KV blocks leaving or entering a tensor-parallel group as full-head tensors (the KV handoff between
workers of any parallel layouts, shared/engine/parallel/kv_heads.py).

Every rank runs the same function for the same message (rank 0 after sending it, ranks 1..N-1 on
receiving it), so the collective inside lines up like a step's: an export gathers each rank's heads of
the blocks to rank 0, an import scatters each rank its heads and writes them into the blocks. Both move
every layer at once, between steps; a model's per-layer hooks run inside the forward, where no other
collective may interleave, so under tensor parallelism KV never leaves layer by layer.
"""

import torch

from kvrelay.shared.engine.parallel.kv_heads import merge_heads, split_heads
from kvrelay.shared.engine.parallel.state import ParallelState
from kvrelay.shared.engine.ranks.group import RankGroup
from kvrelay.shared.wire.rank_step import RankKVExport, RankKVImport


def total_kv_heads(model) -> int:
    """The model's KV heads over the whole group (GPT-2 and BLOOM have one per attention head)."""
    return getattr(model, "total_num_kv_heads", None) or model.total_num_heads


def check_block_ids(kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """Rank 0 checks before any rank indexes: a bad id on a rank would take the group down."""
    if not block_ids or not 0 <= min(block_ids) <= max(block_ids) < kv_cache.shape[2]:
        raise ValueError("KV block id out of range")


def export_blocks(state: ParallelState, kv_cache: torch.Tensor, block_ids: list[int],
                  num_kv_heads: int) -> torch.Tensor | None:
    """``[L, 2, n, bs, num_kv_heads, D]``: every rank's heads of ``block_ids`` on rank 0 (None elsewhere)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    parts = state.gather_to_driver(kv_cache.index_select(2, index))
    return None if parts is None else merge_heads(parts, num_kv_heads)


def import_blocks(state: ParallelState, kv_cache: torch.Tensor, block_ids: list[int],
                  full: torch.Tensor | None) -> None:
    """Write this rank's heads of ``full`` (rank 0's ``[L, 2, n, bs, Hkv, D]``; None elsewhere) into
    ``block_ids`` of its cache."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    mine = kv_cache.new_empty(kv_cache.shape[:2] + (len(block_ids),) + kv_cache.shape[3:])
    parts = None if full is None else split_heads(full.to(kv_cache.device), state.world_size)
    state.scatter_from_driver(parts, mine)
    kv_cache.index_copy_(2, index, mine)


def driver_export(ranks: RankGroup | None, state: ParallelState, kv_cache: torch.Tensor, block_ids: list[int],
                  num_kv_heads: int) -> torch.Tensor:
    """Rank 0: ``export_blocks`` with every rank (a copy of the blocks without tensor parallelism)."""
    check_block_ids(kv_cache, block_ids)
    if ranks is None:
        return export_blocks(state, kv_cache, block_ids, num_kv_heads)
    ranks.send(RankKVExport(list(block_ids)))
    try:
        return export_blocks(state, kv_cache, block_ids, num_kv_heads)
    except RuntimeError as exc:  # the gather broke: a rank died
        raise ranks.down(exc) from exc


def driver_import(ranks: RankGroup | None, state: ParallelState, kv_cache: torch.Tensor, block_ids: list[int],
                  full: torch.Tensor) -> None:
    """Rank 0: ``import_blocks`` with every rank."""
    check_block_ids(kv_cache, block_ids)
    if ranks is None:
        import_blocks(state, kv_cache, block_ids, full)
        return
    ranks.send(RankKVImport(list(block_ids)))
    try:
        import_blocks(state, kv_cache, block_ids, full)
    except RuntimeError as exc:  # the scatter broke: a rank died
        raise ranks.down(exc) from exc
