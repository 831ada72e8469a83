"""A computed transfer that every decode worker refuses looks again, each round in a row twice as long after the
last, up to a cap, and fails with the refusal's reason as its budget ends, over real ZMQ sockets; refused for lack
of room, it keeps the first pace. The sender's clock
is the test's: the schedule is read off it, never measured. A grant starts the waits over."""

import pytest

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.handoff import sender
from kvrelay.shared.handoff.sender import MAX_NO_WORKER_RETRY_S, NO_WORKER_RETRY_S, reask_wait_s
from kvrelay.shared.wire.codec import decode_any, encode
from kvrelay.shared.wire.handoff import HandoffCancel, HandoffGrant, HandoffRequest
from tests.integration.handoff_harness import BLOCK, peer_router, poll_until
from tests.integration.test_handoff_asks import _computed

BUDGET_S = 10.0


class _Clock:
    """Stands in for the sender module's ``time``: still until the test moves it."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = time = monotonic


def _answer_asks(routers, answer) -> int:
    """Answer every ask waiting on ``routers`` with ``answer(ask)`` (a cancel needs none); how many there were."""
    asked = 0
    for router in routers:
        while router.poll(0):
            peer, raw = router.recv_multipart()
            msg = decode_any(raw, HandoffRequest, HandoffCancel)
            if isinstance(msg, HandoffRequest):
                router.send_multipart([peer, encode(answer(msg))])
                asked += 1
    return asked


def _refuse(ask: HandoffRequest) -> HandoffGrant:
    return HandoffGrant(ask.request_id, accepted=False, reason="a KV layout this worker cannot take", ask=ask.ask)


def _full(ask: HandoffRequest) -> HandoffGrant:
    return HandoffGrant(ask.request_id, accepted=False, busy=True, reason="no free seat", ask=ask.ask)


def _rounds(manager, t, clock, routers, answer, rounds: int | None = None) -> tuple[int, list[float]]:
    """Drive ``t`` until it ends (or has waited ``rounds`` times): (asks answered, each wait before a new round)."""
    asked, waits = 0, []
    for _ in range(2000):
        if t.state is State.FAILED or len(waits) == rounds:
            return asked, waits
        manager.poll(20)
        asked += _answer_asks(routers, answer)
        if t.state is State.GRANT_WAIT and not t.target:  # waiting out a round in which nobody took it
            waits.append(round(t.deadline - clock.now, 6))
            clock.now = t.deadline + 1e-6
    raise AssertionError(f"the transfer never ended: {t.state}")


@pytest.fixture()
def clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sender, "time", clock)
    return clock


def test_the_waits_double_from_the_first_up_to_the_cap():
    assert [reask_wait_s(n) for n in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert reask_wait_s(10_000) == MAX_NO_WORKER_RETRY_S and reask_wait_s(0) == NO_WORKER_RETRY_S


@pytest.fixture()
def asking(prefill, clock):
    """``asking(workers)``: a computed transfer on the test's clock, its manager, and the sockets of the ``workers``
    decode workers it asks, in order; closed after."""
    rt, make = prefill
    sockets = []

    def start(workers: int):
        routers = [peer_router() for _ in range(workers)]
        sockets.extend(sock for sock, _ in routers)
        manager = make(routers[0][1], timeout_s=BUDGET_S, also=tuple(addr for _, addr in routers[1:]))
        t = _computed(manager, rt, "r", 4 * BLOCK)
        t.started = clock.now
        return manager, t, tuple(sock for sock, _ in routers)

    yield start
    for sock in sockets:
        sock.close()


def test_refused_by_every_decode_worker_it_backs_off_and_fails_as_its_budget_ends(asking, clock):
    manager, t, routers = asking(2)
    asked, waits = _rounds(manager, t, clock, routers, _refuse)
    # 0.2 + 0.4 + 0.8 + 1.6 + 2 + 2 + 2 = 9 s of waits, the last one cut to what is left of the 10 s budget
    assert waits == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 1.0], abs=1e-4)
    assert asked == 2 * (len(waits) + 1)  # each round asks both workers once, the last as the budget ends
    assert t.reason == "decode worker refused: a KV layout this worker cannot take; no other decode worker to try"


def test_refused_for_lack_of_room_it_keeps_asking_at_the_first_pace(asking, clock):
    """A full batch frees a seat whenever one of its requests ends: a transfer waiting for one does not back off."""
    manager, t, routers = asking(1)
    assert _rounds(manager, t, clock, routers, _full, rounds=6)[1] == pytest.approx([NO_WORKER_RETRY_S] * 6, abs=1e-4)
    assert _rounds(manager, t, clock, routers, _refuse, rounds=2)[1] == pytest.approx([0.2, 0.4], abs=1e-4)


def test_a_grant_starts_the_waits_over(asking, clock):
    manager, t, routers = asking(1)
    assert _rounds(manager, t, clock, routers, _refuse, rounds=3)[1] == pytest.approx([0.2, 0.4, 0.8], abs=1e-4)
    assert t.rounds_refused == 3
    poll_until(manager, lambda: _answer_asks(routers, lambda ask: HandoffGrant(
        ask.request_id, accepted=True, block_ids=[1, 2, 3, 4], ttl_s=5.0, epoch=1, ask=ask.ask)), "the next ask")
    poll_until(manager, lambda: t.grant is not None, "the grant")
    assert t.rounds_refused == 0  # a later round in which nobody takes it waits NO_WORKER_RETRY_S again
