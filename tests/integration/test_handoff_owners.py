"""Who may end a transfer, over real ZMQ sockets: a grant is cancelled only by the peer it was made to (request ids
are no secret, and every peer of the deployment reaches the decode worker's socket), and a transfer is acked or
nacked only by the decode worker its KV went to (another one it asked before may answer about the request too).
The sides are tests/integration/handoff_harness.py's."""

import pytest
import torch

from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffAck, HandoffCancel, HandoffGrant, HandoffRequest
from tests.integration.handoff_harness import BLOCK, MODEL, early, peer_router, poll_until, wait_for
from tests.integration.test_handoff import _dealer

NUM_TOKENS = 4 * BLOCK


def _answered(peer_sock, rid: str) -> HandoffGrant:
    """Ask for ``rid`` on ``peer_sock`` and read the grant: the decode side handled what the socket sent before."""
    peer_sock.send(encode(HandoffRequest(rid, MODEL, num_tokens=BLOCK, block_size=BLOCK)))
    grant = decode(peer_sock.recv(), HandoffGrant)
    assert grant.accepted, grant.reason
    return grant


def test_another_peers_cancel_leaves_the_grant_to_its_owner(prefill, decode_side):
    """A peer cancels a grant made to another by its request id, with epoch 0 (whichever is held) and with the
    grant's own epoch: the grant stays, and its owner's KV lands in it. The peer's own grant it may cancel."""
    rt, make = prefill
    side = decode_side(ttl_s=30.0)  # the grant stays fresh for the prompt, however slow the box
    manager = make(side.addr)
    kv, total = side.rt.core.kv, side.rt.core.kv.num_free_blocks
    t = early(manager, "r", NUM_TOKENS)
    poll_until(manager, lambda: t.state is State.GRANTED, "a grant")
    epoch = t.grant.epoch
    stranger = _dealer(side.addr)
    for cancel_epoch in (0, epoch):
        stranger.send(encode(HandoffCancel("r", reason="not mine to give up", epoch=cancel_epoch)))
    probe = _answered(stranger, "probe")
    held = side.receiver.grants.get("r")
    assert held is not None and held.epoch == epoch and kv.num_free_blocks == total - 4 - 1
    stranger.send(encode(HandoffCancel("probe", reason="mine", epoch=probe.epoch)))
    wait_for(lambda: "probe" not in side.receiver.grants and kv.num_free_blocks == total - 4, "the probe's seat")

    src = rt.core.kv.reserve("r", NUM_TOKENS)
    assert manager.complete("r", FirstToken(3))
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [(e.state, e.grant.epoch) for e in ended] == [(State.DONE, epoch)], ended[0].reason
    wait_for(lambda: "r" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("r")], rt.core.kv.kv_cache[:, :, src])
    stranger.close()


@pytest.mark.parametrize("ok", [True, False])
def test_an_answer_about_the_kv_from_another_decode_worker_is_ignored(prefill, decode_side, ok):
    """The transfer asked worker A first, which refused; its KV went to B. A (or whoever answers on A's
    connection) acks or nacks the request under the grant's epoch while B has not read it yet: neither
    completes nor fails the transfer; B's ack does."""
    rt, make = prefill
    a, a_addr = peer_router()
    b = decode_side()
    manager = make(a_addr, timeout_s=30.0, also=(b.addr,))  # B may be paused for long on a slow box
    answers, on_answer = [], manager._on_answer
    manager._on_answer = lambda peer, msg: (answers.append((peer, type(msg))), on_answer(peer, msg))
    src = rt.core.kv.reserve("r", NUM_TOKENS)
    t = manager.start(synthetic_job("r", NUM_TOKENS, MODEL), b"r", FirstToken(2))
    poll_until(manager, lambda: a.poll(0), "the ask to A")
    a_peer, raw = a.recv_multipart()
    ask = decode(raw, HandoffRequest)
    a.send_multipart([a_peer, encode(HandoffGrant("r", accepted=False, reason="model not served", ask=ask.ask))])
    poll_until(manager, lambda: t.target == b.addr, "the ask to B")
    wait_for(lambda: "r" in b.receiver.grants, "B's grant")
    b.pause()  # B reads neither the KV nor the header until the forged answer was handled
    poll_until(manager, lambda: t.state is State.ACK_WAIT, "the KV and header out to B")
    answers.clear()
    a.send_multipart([a_peer, encode(HandoffAck("r", ok=ok, reason="forged", epoch=t.grant.epoch))])
    poll_until(manager, lambda: answers, "A's answer")
    assert answers == [(a_addr, HandoffAck)]
    assert t.state is State.ACK_WAIT and manager.transfers["r"] is t
    b.paused.clear()
    ended = poll_until(manager, lambda: not manager.transfers, "B's ack")
    assert [e.state for e in ended] == [State.DONE], ended[0].reason
    wait_for(lambda: "r" in b.admitted, "admission")
    assert torch.equal(b.rt.core.kv.kv_cache[:, :, b.blocks("r")], rt.core.kv.kv_cache[:, :, src])
    a.close()
