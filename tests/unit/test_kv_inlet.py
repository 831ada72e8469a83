"""A decode rank's KV inlet (shared/engine/ranks/kv_inlet.py) over real ZMQ sockets, without a group: a sender's
parts may reach the rank before rank 0's RankKVExpect does (the rank's loop was in a step), and must then be
placed, not lost; parts of another requester's grant for the same id, or of an earlier grant of the request (its
epoch), are not."""

import time
import zlib

import pytest
import torch
import zmq

from kvrelay.shared.engine.ranks.kv_inlet import Inlet, reports_address
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import KVLayers
from kvrelay.shared.wire.rank_step import RankInletHello, RankKVDone, RankKVDrop, RankKVExpect

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 6, 2, 1, 4
GRANTED = [1, 4]


@pytest.fixture
def inlet(tmp_path):
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PULL)
    reports.bind(reports_address(tmp_path))
    inlet = Inlet(1, None, "127.0.0.1", tmp_path, (0, 0))
    sender = ctx.socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(inlet.address)
    assert isinstance(next_report(reports), RankInletHello)
    yield inlet, sender, reports
    inlet.close()
    sender.close()
    reports.close(linger=0)
    ctx.term()


def next_report(reports, timeout_ms: int = 10_000):
    assert reports.poll(timeout_ms), "no report from the inlet"
    data = reports.recv()
    for tag in (RankInletHello, RankKVDone):
        try:
            return decode(data, tag)
        except ValueError:
            continue
    raise AssertionError(data)


def send_part(sender, rid: str, requester: str, kv: torch.Tensor, epoch: int = 0) -> None:
    """Every layer and head of ``kv`` ([layers, 2, blocks, bs, heads, D]) as one part, laid out as the
    format says: layer after layer, each [2, blocks, bs, heads, D]."""
    frame = kv.contiguous().numpy().tobytes()
    size = len(frame) // kv.shape[0]
    crcs = [zlib.crc32(frame[i * size:(i + 1) * size]) for i in range(kv.shape[0])]
    msg = KVLayers(request_id=rid, first=0, nbytes=size, checksums=crcs, heads=[0, kv.shape[4]], requester=requester,
                   epoch=epoch)
    sender.send_multipart([encode(msg), frame])


def test_a_part_that_comes_before_its_expect_is_placed_once_expected(inlet):
    rank, sender, reports = inlet
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    kv = torch.randn(LAYERS, 2, len(GRANTED), BLOCK_SIZE, HEADS, DIM)
    send_part(sender, "r1", "prefill-a", kv)
    time.sleep(0.3)  # let the inlet's thread park it
    rank.expect(RankKVExpect("r1", "prefill-a", GRANTED), cache)
    done = next_report(reports)
    assert isinstance(done, RankKVDone) and done.ok and done.request_id == "r1", done
    assert torch.equal(cache[:, :, GRANTED], kv)
    assert not cache[:, :, [0, 2, 3, 5]].any()


def test_a_part_of_another_requesters_grant_is_not_taken_for_this_one(inlet):
    rank, sender, reports = inlet
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    stale, kv = (torch.randn(LAYERS, 2, len(GRANTED), BLOCK_SIZE, HEADS, DIM) for _ in range(2))
    send_part(sender, "r1", "prefill-a", stale)
    time.sleep(0.3)
    rank.expect(RankKVExpect("r1", "prefill-b", GRANTED), cache)
    send_part(sender, "r1", "prefill-b", kv)
    done = next_report(reports)
    assert isinstance(done, RankKVDone) and done.ok, done  # the stale part, taken, would make this one overlap
    assert torch.equal(cache[:, :, GRANTED], kv)


@pytest.mark.parametrize("parked", [True, False], ids=["parked-before-the-new-expect", "after-it"])
def test_a_part_of_an_earlier_grant_of_the_request_is_not_taken_for_the_new_one(inlet, parked):
    """The same requester's request granted again (grant 7, given up, then grant 8): a part of grant 7 that
    comes after, before or after this rank was told of grant 8, is dropped; grant 8's lands alone."""
    rank, sender, reports = inlet
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    stale, kv = (torch.randn(LAYERS, 2, len(GRANTED), BLOCK_SIZE, HEADS, DIM) for _ in range(2))
    rank.expect(RankKVExpect("r1", "prefill-a", GRANTED, epoch=7), cache)
    rank.drop(RankKVDrop("r1", epoch=7))
    if parked:
        send_part(sender, "r1", "prefill-a", stale, epoch=7)
        wait_until(lambda: rank._parked, "the stale part parked")
    rank.expect(RankKVExpect("r1", "prefill-a", GRANTED, epoch=8), cache)
    if not parked:
        send_part(sender, "r1", "prefill-a", stale, epoch=7)
        wait_until(lambda: rank.stale, "the stale part dropped")
    send_part(sender, "r1", "prefill-a", kv, epoch=8)
    done = next_report(reports)
    assert isinstance(done, RankKVDone) and done.ok and done.epoch == 8, done  # taken, the stale part would overlap
    assert torch.equal(cache[:, :, GRANTED], kv)
    assert rank.stale == 1


def test_a_part_of_a_later_grant_waits_for_its_expect(inlet):
    """A part of grant 8 that comes while this rank still expects grant 7 (its loop was in a step when grant 8
    was made) is parked, not dropped: grant 8's expect takes it."""
    rank, sender, reports = inlet
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    kv = torch.randn(LAYERS, 2, len(GRANTED), BLOCK_SIZE, HEADS, DIM)
    rank.expect(RankKVExpect("r1", "prefill-a", GRANTED, epoch=7), cache)
    send_part(sender, "r1", "prefill-a", kv, epoch=8)
    wait_until(lambda: rank._parked, "the early part parked")
    rank.drop(RankKVDrop("r1", epoch=7))
    rank.expect(RankKVExpect("r1", "prefill-a", GRANTED, epoch=8), cache)
    done = next_report(reports)
    assert isinstance(done, RankKVDone) and done.ok and done.epoch == 8, done
    assert torch.equal(cache[:, :, GRANTED], kv) and rank.stale == 0


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.01)
