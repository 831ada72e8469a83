"""KV heads regrouped between a tensor-parallel group's ranks and one full-head tensor: what the KV handoff
moves between workers of different parallel layouts.

On the wire a block always carries all of the model's KV heads in checkpoint order (a one-rank cache's
layout), so either side may be split any way: the sender merges its ranks' heads, the receiver splits
them again by its own layout. Rank r holds the heads ``linear.kv_heads`` gives it: an equal contiguous
share, or, with fewer KV heads than ranks, the one head its query heads read (then several ranks hold
copies of one head, and a merge takes each head once).
"""

import torch

from kvrelay.shared.engine.parallel.linear import kv_heads

HEAD_DIM = -2  # a KV tensor is [..., Hkv, D]


def rank_heads(num_kv_heads: int, world: int) -> list[tuple[int, int]]:
    """(first, count) of every rank's KV heads, in rank order."""
    return [kv_heads(num_kv_heads, rank, world) for rank in range(world)]


def merge_heads(parts: list[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """Every rank's ``[..., its heads, D]`` (rank order) -> ``[..., num_kv_heads, D]``; a head several
    ranks hold is taken from the first of them."""
    taken: list[torch.Tensor] = []
    have = 0
    for part, (first, count) in zip(parts, rank_heads(num_kv_heads, len(parts)), strict=True):
        if part.shape[HEAD_DIM] != count:
            raise ValueError(f"a rank's KV has {part.shape[HEAD_DIM]} heads where its share is {count}")
        if first == have:  # a replica of a head already taken is skipped
            taken.append(part)
            have += count
    if have != num_kv_heads:
        raise ValueError(f"the ranks' KV heads cover {have} of {num_kv_heads}")
    return torch.cat(taken, dim=HEAD_DIM)


def split_heads(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    """``[..., num_kv_heads, D]`` -> every rank's ``[..., its heads, D]`` (views), in rank order."""
    return [full.narrow(HEAD_DIM, first, count) for first, count in rank_heads(full.shape[HEAD_DIM], world)]
