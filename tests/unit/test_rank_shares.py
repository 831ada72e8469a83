"""How a sharded prefill rank's part is split among a sharded decode worker's ranks (``shares``, by the grant's
targets), and how a decode rank places a share into its own cache (``ShareAssembler``: the model's layers and
heads from its origin, each layer CRC-checked, overlaps and strays refused)."""

import pytest
import torch

from kvrelay.shared.engine.ranks.kv_parts import Part, part_messages, shares
from kvrelay.shared.engine.ranks.kv_share import ShareAssembler
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.handoff import KVLayers, KVTarget


def _cache(layers: int, heads: int, blocks: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn((layers, 2, blocks, 8, heads, 4), generator=torch.Generator().manual_seed(seed))


def test_no_targets_sends_the_whole_part_to_the_grant_socket():
    part = Part(range(0, 2), 0, 2)
    assert shares(part, []) == [("", part)]


def test_a_part_is_split_by_each_targets_layers_and_heads_and_replicas_get_their_own_copy():
    part = Part(range(0, 4), 2, 2)  # a prefill rank holding heads 2..3 of 4 layers
    targets = [KVTarget("", [0, 2], [0, 4]), KVTarget("tcp://a:1", [2, 4], [0, 4]),  # decode PP2
               KVTarget("tcp://b:2", [0, 4], [3, 1]), KVTarget("tcp://c:3", [0, 4], [0, 2])]  # none of ours
    assert shares(part, targets) == [("", Part(range(0, 2), 2, 2)), ("tcp://a:1", Part(range(2, 4), 2, 2)),
                                     ("tcp://b:2", Part(range(0, 4), 3, 1))]


def test_a_decode_rank_places_its_share_from_its_origin_and_completes_once_every_cell_is_in():
    prefill = _cache(4, 2, seed=1)  # a prefill rank: 4 layers, the model's heads 2..3
    part, blocks = Part(range(0, 4), 2, 2), [3, 1]
    mine = torch.zeros((2, 2, 6, 8, 1, 4))  # a decode rank of stage 2 (layers 2..3) holding head 3
    assembler = ShareAssembler(mine, [5, 0], origin=(2, 3))
    share = Part(range(2, 4), 3, 1)
    for encoded, frame in part_messages(prefill, blocks, part, "r", "p1", share):
        assert not assembler.complete
        assembler.add(decode(encoded, KVLayers), [frame])
    assert assembler.complete and assembler.nbytes == prefill[2:4, :, blocks, :, 1:2].numel() * 4
    assert torch.equal(mine[:, :, [5, 0]], prefill[2:4, :, blocks][:, :, :, :, 1:2])


def test_a_share_outside_the_rank_overlapping_or_corrupt_is_refused():
    prefill, part = _cache(2, 2, seed=2), Part(range(0, 2), 0, 2)
    (encoded, frame), = part_messages(prefill, [0], part, "r", "p1")
    msg = decode(encoded, KVLayers)
    with pytest.raises(ValueError, match="outside this rank"):
        ShareAssembler(torch.zeros((2, 2, 4, 8, 1, 4)), [0], origin=(0, 1)).add(msg, [frame])
    assembler = ShareAssembler(torch.zeros((2, 2, 4, 8, 2, 4)), [0], origin=(0, 0))
    bad = bytearray(frame)
    bad[0] ^= 1
    with pytest.raises(ValueError, match="checksum mismatch in layer 0"):
        assembler.add(msg, [bad])
    assembler.add(msg, [frame])
    with pytest.raises(ValueError, match="overlaps"):
        assembler.add(msg, [frame])
