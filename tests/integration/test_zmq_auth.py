"""Internal sockets admit only the deployment (issue #13), over real ZMQ sockets: a decode ROUTER and
the gateway's event PULL set up as the workers and the gateway set them up (shared/wire/zmq_auth.py).
A peer without the secret, or with another deployment's, or with the public key but not the secret,
gets nothing in; an authenticated peer over the grant cap is refused while another still gets grants."""

import asyncio
import time

import pytest
import zmq

from kvrelay.gateway.dispatcher import Dispatcher
from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.config.zmq_secret import generate
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffRequest
from kvrelay.shared.wire.protocol import TokenBatch, TokenEvent
from kvrelay.shared.wire.zmq_auth import CurveKeys, keys_from_secret
from tests.integration.handoff_harness import BLOCK, MODEL, hand_off_tiny, wait_for
from tests.zmq_secret import CURVE

FLOOD = 256
SILENCE_S = 1.0  # how long an outsider waits for an answer that must never come


def _stranger_knowing_the_public_key() -> CurveKeys:
    """Its own keypair, and the deployment's public key (which is no secret): the ZAP handler's case."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(public=public, secret=secret)


def _dealer(ctx: zmq.Context, addr: str, keys: CurveKeys | None, server_key: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        zmq_auth.dial(sock, keys)
        if server_key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.connect(addr)
    return sock


OUTSIDERS = {
    "no keys": lambda: (None, None),
    "another deployment": lambda: (keys_from_secret(generate()), None),
    "the public key without the secret": lambda: (_stranger_knowing_the_public_key(), CURVE.public),
}


@pytest.mark.parametrize("outsider", list(OUTSIDERS))
def test_forged_requests_from_outside_get_nothing_and_take_no_seat(prefill, decode_side, outsider):
    rt, make = prefill
    side = decode_side()
    free = side.rt.core.kv.num_free_blocks
    ctx = zmq.Context()
    keys, server_key = OUTSIDERS[outsider]()
    evil = _dealer(ctx, side.addr, keys, server_key)
    try:
        for i in range(FLOOD):
            try:
                evil.send(encode(HandoffRequest(f"forged-{i}", MODEL, num_tokens=BLOCK, block_size=BLOCK)),
                          zmq.NOBLOCK)
            except zmq.Again:  # the handshake was refused before this send: no pipe left to queue it on
                break
        assert not evil.poll(int(SILENCE_S * 1000)), "an outsider got an answer"
        assert not side.receiver.grants and side.rt.core.kv.num_free_blocks == free
        t, src = hand_off_tiny(make(side.addr), rt, "genuine", 4 * BLOCK)  # the deployment's own still gets in
        assert t.state is State.DONE, t.reason
        wait_for(lambda: "genuine" in side.admitted, "admission")
        assert set(side.admitted) == {"genuine"}
    finally:
        evil.close()
        ctx.destroy(linger=0)


def test_a_peer_over_the_grant_cap_is_refused_while_another_still_gets_grants(decode_side):
    side = decode_side()
    side.receiver.max_per_peer = 3
    ctx = zmq.Context()
    greedy, other = _dealer(ctx, side.addr, CURVE), _dealer(ctx, side.addr, CURVE)
    greedy.setsockopt(zmq.RCVTIMEO, 15_000)
    other.setsockopt(zmq.RCVTIMEO, 15_000)

    def ask(sock: zmq.Socket, rid: str) -> HandoffGrant:
        sock.send(encode(HandoffRequest(rid, MODEL, num_tokens=BLOCK, block_size=BLOCK)))
        return decode(sock.recv(), HandoffGrant)

    try:
        assert all(ask(greedy, f"g{i}").accepted for i in range(3))
        refused = ask(greedy, "g3")
        assert not refused.accepted and "--max-handoffs-per-peer" in refused.reason
        assert ask(other, "o0").accepted  # the cap is per peer: the batch has room for the others
        assert set(side.receiver.grants) == {"g0", "g1", "g2", "o0"}
    finally:
        greedy.close()
        other.close()
        ctx.destroy(linger=0)


def test_the_gateway_takes_token_events_only_from_the_deployment():
    async def run() -> tuple[TokenEvent | None, TokenEvent | None, int]:
        dispatcher = Dispatcher("127.0.0.1", 0, "127.0.0.1", curve=CURVE)
        await dispatcher.start()
        queue = dispatcher.register(["r1", "r2"])
        ctx = zmq.Context()
        try:
            outsider, worker = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
            zmq_auth.dial(worker, CURVE)
            for sock in (outsider, worker):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(dispatcher.address)
            outsider.send(encode(TokenBatch(events=[TokenEvent(request_id="r1", token_ids=[666])])))
            started = time.monotonic()
            while time.monotonic() - started < SILENCE_S:
                await asyncio.sleep(0.05)
            forged = queue.get_nowait() if not queue.empty() else None
            worker.send(encode(TokenBatch(events=[TokenEvent(request_id="r2", token_ids=[7])])))
            genuine = await asyncio.wait_for(queue.get(), 15)
            return forged, genuine, dispatcher.malformed
        finally:
            ctx.destroy(linger=0)
            await dispatcher.close()

    forged, genuine, malformed = asyncio.run(run())
    assert forged is None and malformed == 0
    assert genuine is not None and genuine.request_id == "r2"


def test_no_secret_means_no_socket_unless_insecure_was_asked_for():
    with pytest.raises(ValueError, match="--insecure-zmq"):
        keys_from_secret(None)
    assert keys_from_secret(None, insecure=True) is None
    keys = keys_from_secret("ab" * 32)
    assert keys == keys_from_secret("ab" * 32) and keys.public == zmq.curve_public(keys.secret)
    assert keys.secret.decode() not in repr(keys)
