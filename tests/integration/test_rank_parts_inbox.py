"""The decode side's handling of KV sent in parts by a sharded prefill worker's ranks, over real CURVE ZMQ
sockets into a real HandoffReceiver: the asker's socket gets the grant, the header and the ack; each rank's
part comes from a socket of its own and is matched to the grant by its requester (a part naming another
requester is dropped, opening nothing); the header may come before the last part, and the request is
admitted and acked only once every (layer, head) is in."""

import time

import pytest
import torch
import zmq

from kvrelay.shared.engine.ranks.kv_parts import Part, part_messages
from kvrelay.shared.handoff.blocks import frame_nbytes, layout_of
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode_any, encode
from kvrelay.shared.wire.handoff import HandoffAck, HandoffCancel, HandoffGrant, HandoffRequest, KVHeader
from tests.integration.handoff_harness import BLOCK, MODEL, SHAPE, DecodeSide
from tests.zmq_secret import CURVE

pytestmark = pytest.mark.timeout(120)
TOKENS = 3 * BLOCK - 5


def _dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    zmq_auth.dial(sock, CURVE)
    sock.connect(addr)
    return sock


def _reply(sock: zmq.Socket):
    assert sock.poll(10_000), "no reply from the decode side"
    return decode_any(sock.recv_multipart()[0], HandoffGrant, HandoffAck)


def _wait(what: str, ready) -> None:
    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.01)


@pytest.fixture()
def decode():
    side = DecodeSide(torch.zeros(SHAPE))
    yield side
    side.close()


def test_parts_from_the_ranks_sockets_land_and_the_asker_gets_the_ack(decode):
    src = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    src_blocks = [5, 9, 2]
    ctx = zmq.Context()
    asker, rank1, intruder = (_dealer(ctx, decode.addr) for _ in range(3))
    try:
        asker.send_multipart([encode(HandoffRequest("r", MODEL, TOKENS, BLOCK, requester="p1"))])
        grant = _reply(asker)
        assert grant.accepted and len(grant.block_ids) == 3
        half = SHAPE[4] // 2
        mine, theirs = (part_messages(src[..., h:h + half, :].clone(), src_blocks, Part(range(SHAPE[0]), h, half),
                                      "r", "p1", epoch=grant.epoch) for h in (0, half))
        # the same part under another requester: dropped, no transfer opened for it
        forged = part_messages(src[..., half:, :].clone(), src_blocks, Part(range(SHAPE[0]), half, half), "r", "p2",
                               epoch=grant.epoch)
        for raw, frame in forged:
            intruder.send_multipart([raw, frame])
        for raw, frame in mine:  # rank 0's part, from a socket that is not the asker's either
            rank1.send_multipart([raw, frame])
        _wait("rank 0's part", lambda: "r" in decode.receiver.incoming
              and decode.receiver.incoming["r"].receiver.parts == len(mine))
        time.sleep(0.2)
        assert decode.receiver.incoming["r"].receiver.parts == len(mine)  # the forged part was never taken
        header = KVHeader(job=synthetic_job("r", TOKENS, MODEL), **layout_of(src), num_blocks=3,
                          block_ids=grant.block_ids, transport="rank_layers",
                          nbytes=SHAPE[0] * frame_nbytes(src, 3), first_token_id=2, first_logprob=None,
                          first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0, epoch=grant.epoch)
        asker.send_multipart([encode(header)])  # before the other rank's part: it waits for it
        _wait("the header", lambda: decode.receiver.incoming.get("r") is not None
              and decode.receiver.incoming["r"].header is not None)
        assert "r" not in decode.admitted
        for raw, frame in theirs:
            intruder.send_multipart([raw, frame])  # a socket that sent a forged part may still carry a real one
        ack = _reply(asker)
        assert ack.ok, ack.reason
        assert torch.equal(decode.rt.core.kv.kv_cache[:, :, decode.blocks("r")], src[:, :, src_blocks])
        assert not rank1.poll(200)  # replies go to the asker alone
    finally:
        ctx.destroy(linger=0)


def test_a_part_of_a_cancelled_grant_still_in_flight_is_not_taken_for_the_request_granted_again(decode):
    """The asker gives a grant up and asks again for the same request; a rank's part of the old grant comes in
    after the new grant was made (the ranks send from sockets of their own: nothing orders it behind the cancel).
    Same request id, same requester: only the grant's epoch tells it from the new grant's parts."""
    src, stale_src = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    src_blocks = [5, 9, 2]
    ctx = zmq.Context()
    asker, rank = _dealer(ctx, decode.addr), _dealer(ctx, decode.addr)
    try:
        asker.send_multipart([encode(HandoffRequest("r", MODEL, TOKENS, BLOCK, requester="p1"))])
        old = _reply(asker)
        asker.send_multipart([encode(HandoffCancel("r", "the prompt waited too long", old.epoch))])
        asker.send_multipart([encode(HandoffRequest("r", MODEL, TOKENS, BLOCK, requester="p1"))])
        grant = _reply(asker)
        assert grant.accepted and grant.epoch != old.epoch
        whole = Part(range(SHAPE[0]), 0, SHAPE[4])
        stale = part_messages(stale_src, src_blocks, whole, "r", "p1", epoch=old.epoch)
        for raw, frame in stale:
            rank.send_multipart([raw, frame])  # every (layer, head): taken, it would leave no room for the real one
        for raw, frame in part_messages(src, src_blocks, whole, "r", "p1", epoch=grant.epoch):
            rank.send_multipart([raw, frame])
        header = KVHeader(job=synthetic_job("r", TOKENS, MODEL), **layout_of(src), num_blocks=3,
                          block_ids=grant.block_ids, transport="rank_layers",
                          nbytes=SHAPE[0] * frame_nbytes(src, 3), first_token_id=2, first_logprob=None,
                          first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0, epoch=grant.epoch)
        asker.send_multipart([encode(header)])
        ack = _reply(asker)
        assert ack.ok and ack.epoch == grant.epoch, ack.reason
        assert torch.equal(decode.rt.core.kv.kv_cache[:, :, decode.blocks("r")], src[:, :, src_blocks])
        assert decode.receiver.stale == len(stale)
    finally:
        ctx.destroy(linger=0)
