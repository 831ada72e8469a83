"""A transfer takes only the answer to its latest ask: a reply to an earlier one (to a decode worker it stopped
waiting for, or to the same one before asking it again) arrives late, over real ZMQ sockets, and is not taken;
a grant in it is given back, freeing its seat there."""

from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.wire.codec import decode, decode_any, encode
from kvrelay.shared.wire.handoff import HandoffCancel, HandoffGrant, HandoffRequest
from tests.integration.handoff_harness import BLOCK, MODEL, early, peer_router, poll_until, wait_for

TIMEOUT_S = 1.0  # how long the first decode worker is left unanswered before the transfer asks the next


def _computed(manager, rt, rid: str, num_tokens: int):
    rt.core.kv.reserve(rid, num_tokens)
    return manager.start(synthetic_job(rid, num_tokens, MODEL), rid.encode(), FirstToken(2))


def _next_ask(manager, router) -> tuple[bytes, HandoffRequest]:
    poll_until(manager, lambda: router.poll(0), "an ask")
    peer, raw = router.recv_multipart()
    return peer, decode(raw, HandoffRequest)


def _grant(epoch: int, ask: int) -> bytes:
    return encode(HandoffGrant("r", accepted=True, block_ids=[1, 2, 3, 4], ttl_s=5.0, epoch=epoch, ask=ask))


def test_a_late_grant_from_the_worker_asked_before_is_given_back_not_taken(prefill, decode_side):
    """Worker A answers only after the transfer gave up on it and asked B: A's grant must neither be taken (the KV
    would go to A while B holds a seat for it) nor kept there (A keeps a live asker's grants up to two minutes)."""
    rt, make = prefill
    a = decode_side(asker_alive=lambda worker_id: True)
    total = a.rt.core.kv.num_free_blocks
    b, b_addr = peer_router()
    manager = make(a.addr, timeout_s=TIMEOUT_S, also=(b_addr,))
    answers, on_answer = [], manager._on_answer
    manager._on_answer = lambda peer, msg: (answers.append((peer, msg.ask)), on_answer(peer, msg))
    a.pause()
    t = _computed(manager, rt, "r", 4 * BLOCK)
    peer, ask = _next_ask(manager, b)
    assert ask.ask == 2 and t.target == b_addr
    a.paused.clear()
    wait_for(lambda: "r" in a.receiver.grants, "A's grant of the first ask")
    manager.poll(10_000)  # A's grant arrives while the transfer waits for B's answer
    assert answers == [(a.addr, 1)]  # A's real receiver echoes the ask it answers
    assert t.state is State.GRANT_WAIT and t.target == b_addr and t.grant is None
    wait_for(lambda: "r" not in a.receiver.grants and a.rt.core.kv.num_free_blocks == total, "A's seat freed")
    b.send_multipart([peer, _grant(epoch=9, ask=2)])
    poll_until(manager, lambda: t.grant is not None, "B's grant")
    assert t.state in (State.SENDING, State.ACK_WAIT) and t.grant.epoch == 9 and t.target == b_addr
    b.close()


def test_a_late_refusal_from_the_worker_asked_before_leaves_the_latest_ask_waiting(prefill):
    """A refuses only after the transfer asked B: that is no answer about B, which may be about to grant."""
    rt, make = prefill
    a, a_addr = peer_router()
    b, b_addr = peer_router()
    manager = make(a_addr, timeout_s=TIMEOUT_S, also=(b_addr,))
    t = _computed(manager, rt, "r", 4 * BLOCK)
    a_peer, first = _next_ask(manager, a)
    b_peer, second = _next_ask(manager, b)
    assert (first.ask, second.ask) == (1, 2)
    a.send_multipart([a_peer, encode(HandoffGrant("r", accepted=False, reason="no free blocks", ask=1))])
    manager.poll(10_000)
    assert t.state is State.GRANT_WAIT and t.target == b_addr and not a.poll(0) and not b.poll(0)  # no new ask
    b.send_multipart([b_peer, _grant(epoch=9, ask=2)])
    poll_until(manager, lambda: t.grant is not None, "B's grant")
    assert t.state in (State.SENDING, State.ACK_WAIT) and t.grant.epoch == 9
    a.close()
    b.close()


def test_a_late_grant_to_an_earlier_ask_of_the_same_worker_is_given_back(prefill):
    """An early ask goes unanswered, parks, and once the prompt is computed asks the same worker again: the grant
    answering the first ask, arriving now, is given back by its epoch; the one answering the second is taken."""
    rt, make = prefill
    a, a_addr = peer_router()
    manager = make(a_addr, timeout_s=TIMEOUT_S)
    t = early(manager, "r", 4 * BLOCK)
    peer, first = _next_ask(manager, a)
    poll_until(manager, lambda: t.state is State.PARKED, "the unanswered early ask to park")
    assert decode(a.recv_multipart()[1], HandoffCancel).epoch == 0  # whichever it gets
    rt.core.kv.reserve("r", 4 * BLOCK)
    assert manager.complete("r", FirstToken(2))
    _, second = _next_ask(manager, a)
    assert (first.ask, second.ask) == (1, 2)
    a.send_multipart([peer, _grant(epoch=7, ask=1)])
    poll_until(manager, lambda: a.poll(0), "the late grant given back")
    assert decode_any(a.recv_multipart()[1]) == HandoffCancel("r", reason="granted for an ask given up", epoch=7)
    assert t.state is State.GRANT_WAIT and t.grant is None
    a.send_multipart([peer, _grant(epoch=8, ask=2)])
    poll_until(manager, lambda: t.grant is not None, "the second ask's grant")
    assert t.state in (State.SENDING, State.ACK_WAIT) and t.grant.epoch == 8
    a.close()
