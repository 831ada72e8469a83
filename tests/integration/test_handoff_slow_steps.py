"""Grants and a prefill worker whose engine steps outlast the grant TTL, over real ZMQ sockets (the two
sides of tests/integration/handoff_harness.py). The prefill side reads the decode side's replies only
between steps; on a slow host (a CPU prefilling thousands of tokens in one step) a grant used to lapse
before its reply was read, and the KV that followed got "no grant for this request" (a 500 for the whole
request, n=128 siblings included). A short TTL and sleeps stand in for that host's long steps."""

import time

import torch
import zmq

from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffCancel, HandoffGrant, HandoffRequest
from tests.integration.handoff_harness import (
    BLOCK,
    MODEL,
    early,
    poll_until,
    wait_for,
)
from tests.integration.test_handoff import _dealer
from tests.zmq_secret import CURVE

TTL_S = 0.2
STEP_S = 0.8  # one engine step of the prefill worker: four grant lifetimes


def test_a_grant_read_after_a_step_longer_than_its_ttl_still_takes_the_kv(prefill, decode_side):
    """The decode side keeps a lapsed grant while its asker still heartbeats: that asker is in a long
    step, not gone, and its KV lands when the step ends."""
    rt, make = prefill
    side = decode_side(ttl_s=TTL_S, asker_alive=lambda worker_id: worker_id == "p1")
    manager = make(side.addr)
    src = rt.core.kv.reserve("slow", 4 * BLOCK)
    manager.prefilled(synthetic_job("slow", 4 * BLOCK, MODEL), b"slow", FirstToken(3))
    manager.poll(0)  # the ask goes out; our first step, so no hold measured yet: the grant's TTL is the base
    time.sleep(STEP_S)  # the step, during which the grant comes and lapses
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [(e.job.request_id, e.state) for e in ended] == [("slow", State.DONE)], ended[0].reason
    wait_for(lambda: "slow" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("slow")], rt.core.kv.kv_cache[:, :, src])


def test_asks_say_how_long_the_askers_steps_take_and_grants_live_that_long(prefill, decode_side):
    """Without a way to tell whether the asker lives, the grant lives as long as the ask says the asker's
    steps take (HandoffRequest.hold_s, from the gaps between its reads of the socket)."""
    rt, make = prefill
    side = decode_side(ttl_s=TTL_S)  # no liveness: a grant lapses at its TTL, as for a dead asker
    manager = make(side.addr)
    for _ in range(3):  # a few slow steps with nothing to hand off
        manager.poll(0)
        time.sleep(STEP_S)
    src = rt.core.kv.reserve("measured", 4 * BLOCK)
    manager.prefilled(synthetic_job("measured", 4 * BLOCK, MODEL), b"measured", FirstToken(3))
    manager.poll(0)
    t = manager.transfers["measured"]
    time.sleep(STEP_S)
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [e.state for e in ended] == [State.DONE], ended[0].reason
    assert t.grant.ttl_s >= 3 * STEP_S  # several of our steps, not the decode side's 0.2 s
    wait_for(lambda: "measured" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("measured")], rt.core.kv.kv_cache[:, :, src])


def test_a_dead_askers_grant_lapses_and_a_live_ones_is_kept_until_cancelled(decode_side):
    side = decode_side(ttl_s=TTL_S, asker_alive=lambda worker_id: worker_id == "alive")
    kv = side.rt.core.kv
    total = kv.num_free_blocks
    socks = {}
    for who in ("alive", "dead"):
        socks[who] = _dealer(side.addr)
        socks[who].send(encode(HandoffRequest(who, MODEL, num_tokens=4 * BLOCK, block_size=BLOCK, requester=who)))
        assert decode(socks[who].recv(), HandoffGrant).accepted
    wait_for(lambda: "dead" not in side.receiver.grants, "the dead asker's grant to lapse")
    time.sleep(4 * TTL_S)
    assert set(side.receiver.grants) == {"alive"} and kv.num_free_blocks == total - 4
    socks["alive"].send(encode(HandoffCancel("alive", reason="the asker gave up")))
    wait_for(lambda: kv.num_free_blocks == total, "the cancelled grant's blocks")
    for sock in socks.values():
        sock.close()


def test_a_grant_that_comes_after_the_asker_stopped_waiting_is_given_back(prefill):
    """Since a live asker's grants are kept past their TTL, one it no longer wants must be cancelled: an
    early ask that got no answer in time parks, and the grant that comes after is handed back at once."""
    rt, make = prefill
    router = zmq.Context.instance().socket(zmq.ROUTER)  # a decode worker that answers late
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 15_000)
    zmq_auth.serve(router, CURVE)
    addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    manager = make(addr, timeout_s=0.3)
    t = early(manager, "late", 4 * BLOCK)
    manager.poll(0)
    peer, ask = router.recv_multipart()
    assert decode(ask, HandoffRequest).request_id == "late"
    poll_until(manager, lambda: t.state is State.PARKED, "the unanswered early ask to park")
    router.send_multipart([peer, encode(HandoffGrant("late", accepted=True, block_ids=[1, 2, 3, 4], ttl_s=TTL_S))])
    cancels = []
    deadline = time.monotonic() + 15
    while len(cancels) < 2 and time.monotonic() < deadline:
        manager.poll(20)
        if router.poll(0):
            cancels.append(decode(router.recv_multipart()[1], HandoffCancel))
    # one when it parked (in case a grant was on its way), one for the grant that then came
    assert [c.request_id for c in cancels] == ["late", "late"] and t.state is State.PARKED
    router.close()
