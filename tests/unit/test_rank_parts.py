"""KV sent in parts by a sharded prefill worker's ranks (shared/engine/ranks/kv_parts.py builds them,
shared/handoff/rank_parts.py places them): every rank's layers and heads land in their place in the granted
blocks, in any order, bit for bit; a transfer is complete only once every (layer, head) arrived and was
checked; a part that overlaps another, has the wrong size, or fails its CRC is refused."""

import random
from types import SimpleNamespace

import pytest
import torch

from kvrelay.shared.engine.parallel.layout import RankLayout
from kvrelay.shared.engine.ranks.kv_parts import Part, part_messages, rank_part
from kvrelay.shared.handoff.rank_parts import PartAssembler
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import KVLayers
from kvrelay.shared.wire.rank_step import RankKVSend

SHAPE = (3, 2, 10, 4, 2, 8)  # [L, 2, N, bs, Hkv, D]: 3 layers, 2 KV heads
SRC_BLOCKS, DST_BLOCKS = [3, 7, 1], [0, 9, 5]


def _cache(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)


def _parts(src: torch.Tensor, stages: list[tuple[int, int]], heads: list[tuple[int, int]]) -> list[tuple[KVLayers, bytes]]:
    """The messages every rank of a (stages x head shares) group sends, each from its own cache's slice."""
    msgs = []
    for start, end in stages:
        for first, count in heads:
            rank_cache = src[start:end, ..., first:first + count, :].clone()
            for raw, frame in part_messages(rank_cache, SRC_BLOCKS, Part(range(start, end), first, count), "r", "p1"):
                msgs.append((decode(raw, KVLayers), bytes(frame)))
    return msgs


def _assemble(dst: torch.Tensor, msgs) -> PartAssembler:
    asm = PartAssembler(dst, DST_BLOCKS)
    for msg, frame in msgs:
        asm.add(msg, [frame])
    return asm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("stages", "heads"), [([(0, 3)], [(0, 1), (1, 1)]), ([(0, 2), (2, 3)], [(0, 2)]),
                                               ([(0, 2), (2, 3)], [(0, 1), (1, 1)])],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_every_ranks_part_lands_in_its_layers_and_heads_in_any_order(stages, heads, dtype):
    src, dst = _cache(dtype), torch.zeros(SHAPE, dtype=dtype)
    msgs = _parts(src, stages, heads)
    assert all(m.heads and m.requester == "p1" for m, _ in msgs)
    random.Random(1).shuffle(msgs)
    asm = PartAssembler(dst, DST_BLOCKS)
    for msg, frame in msgs:
        assert not asm.complete  # a part is still missing
        asm.add(msg, [frame])
    assert asm.complete and asm.error() is None
    asm.finish()
    dst, src = dst.view(torch.uint8), src.view(torch.uint8)  # bit for bit (an fp8 cache moves as its bytes)
    assert torch.equal(dst[:, :, DST_BLOCKS], src[:, :, SRC_BLOCKS])
    untouched = [b for b in range(SHAPE[2]) if b not in DST_BLOCKS]
    assert not dst[:, :, untouched].any()


def test_overlapping_wrong_sized_and_whole_head_parts_are_refused():
    src, dst = _cache(), torch.zeros(SHAPE)
    msgs = _parts(src, [(0, 3)], [(0, 1), (1, 1)])
    asm = _assemble(dst, msgs[:1])
    with pytest.raises(ValueError, match="overlaps one already taken"):
        asm.add(*msgs[0][:1], [msgs[0][1]])
    msg, frame = msgs[1]
    with pytest.raises(ValueError, match="KV part frame of"):
        asm.add(msg, [frame[:-4]])
    with pytest.raises(ValueError, match="for a model of 3 x 2"):
        asm.add(KVLayers("r", first=0, nbytes=msg.nbytes, checksums=msg.checksums, heads=[1, 2], requester="p1"),
                [frame])
    with pytest.raises(ValueError, match="without its heads"):
        asm.add(KVLayers("r", first=0, nbytes=msg.nbytes, checksums=msg.checksums), [frame])
    assert not asm.complete  # heads 1 never came


def test_a_part_with_a_bad_checksum_fails_the_transfer():
    src, dst = _cache(), torch.zeros(SHAPE)
    msgs = _parts(src, [(0, 3)], [(0, 1), (1, 1)])
    msg, frame = msgs[1]
    bad = bytearray(frame)
    bad[5] ^= 0xFF
    asm = _assemble(dst, [msgs[0], (msg, bytes(bad))])
    assert isinstance(asm.error(), ValueError) and "checksum" in str(asm.error())


def test_a_head_several_ranks_hold_is_sent_by_the_first_of_them():
    """2 KV heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1."""
    model = SimpleNamespace(num_layers=2, stage=SimpleNamespace(size=1), total_num_kv_heads=2)
    parts = [rank_part(model, RankLayout(r, 4, 1)) for r in range(4)]
    assert parts == [Part(range(0, 2), 0, 1), None, Part(range(0, 2), 1, 1), None]
    stages = SimpleNamespace(num_layers=3, stage=SimpleNamespace(size=2), total_num_kv_heads=2)
    assert [rank_part(stages, RankLayout(r, 1, 2)) for r in range(2)] == [Part(range(0, 2), 0, 2),
                                                                           Part(range(2, 3), 0, 2)]


def test_part_messages_are_typed_on_the_wire():
    msg = RankKVSend("r", [1, 2], "tcp://127.0.0.1:5555", "p1", 10.0)
    assert decode(encode(msg), RankKVSend) == msg
    with pytest.raises(ValueError, match="requester"):
        decode(encode(KVLayers("r", first=0, nbytes=4, checksums=[1], heads=[0, 1])), KVLayers)
    with pytest.raises(ValueError, match="peer"):
        decode(encode(RankKVSend("r", [1], "http://x", "p1", 10.0)), RankKVSend)
