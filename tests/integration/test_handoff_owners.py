"""Who may end a transfer, over real ZMQ sockets: a grant is cancelled only by the peer it was made to (request ids
are no secret, and every peer of the deployment reaches the decode worker's socket). The sides are
tests/integration/handoff_harness.py's."""

import torch

from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffCancel, HandoffGrant, HandoffRequest
from tests.integration.handoff_harness import BLOCK, MODEL, early, poll_until, wait_for
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
    side = decode_side()
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
