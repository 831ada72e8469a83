"""KV heads regrouped between tensor-parallel ranks and full-head blocks (the handoff across parallel
layouts) agree with plain torch slicing of the heads, also when ranks hold copies of one head."""

import pytest
import torch

from kvrelay.shared.engine.parallel.kv_heads import merge_heads, rank_heads, split_heads


def _full(num_kv_heads: int) -> torch.Tensor:
    # [L, 2, n, bs, Hkv, D] with every element distinct, so a misplaced head cannot go unnoticed
    return torch.arange(2 * 2 * 3 * 4 * num_kv_heads * 5, dtype=torch.float32).view(2, 2, 3, 4, num_kv_heads, 5)


def _plain_share(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A rank's heads by hand: an equal contiguous share, or with fewer heads than ranks the head its
    query heads read (ranks r*H/world .. share one head)."""
    heads = full.shape[-2]
    if heads >= world:
        per = heads // world
        return full[..., rank * per:(rank + 1) * per, :]
    return full[..., rank * heads // world:rank * heads // world + 1, :]


@pytest.mark.parametrize(("heads", "world"), [(2, 1), (2, 2), (4, 2), (8, 4), (1, 2), (2, 4), (2, 8)])
def test_split_gives_each_rank_its_heads_and_merge_restores_the_blocks(heads, world):
    full = _full(heads)
    parts = split_heads(full, world)
    assert len(parts) == world
    for rank, part in enumerate(parts):
        assert torch.equal(part, _plain_share(full, rank, world))
    assert torch.equal(merge_heads([p.clone() for p in parts], heads), full)


def test_replicated_heads_are_taken_once_from_the_first_rank_holding_them():
    # two KV heads over four ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1
    assert rank_heads(2, 4) == [(0, 1), (0, 1), (1, 1), (1, 1)]
    full = _full(2)
    parts = [p.clone() for p in split_heads(full, 4)]
    parts[1].fill_(-1.0)  # a replica's copy is never read
    parts[3].fill_(-1.0)
    assert torch.equal(merge_heads(parts, 2), full)


def test_a_rank_with_the_wrong_head_count_is_refused():
    full = _full(4)
    with pytest.raises(ValueError, match="a rank's KV has 4 heads where its share is 2"):
        merge_heads([full, full], 4)
