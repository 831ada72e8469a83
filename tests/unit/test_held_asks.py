"""The decode side's held asks (shared/handoff/held_asks.py) as a state machine, without sockets: which transfer an
ask waits for, when it is answered (its transfer left the flight; another one brings more; its wait bound passed),
and that asking again or cancelling drops it."""

import time

from kvrelay.shared.handoff.held_asks import HeldAsks, HoldState, best_provider, shared_blocks
from kvrelay.shared.wire.handoff import HandoffRequest
from kvrelay.shared.worker.held_ask_metrics import OUTCOMES

BLOCK = 4


def ask(rid: str, hashes: list[int], num_tokens: int | None = None) -> HandoffRequest:
    return HandoffRequest(request_id=rid, model="m", num_tokens=num_tokens or len(hashes) * BLOCK + 1,
                          block_size=BLOCK, block_hashes=hashes)


def test_shared_blocks_is_the_common_leading_run_of_two_chains():
    chain = [11, 12, 13, 14, 15]
    assert [shared_blocks(chain, other) for other in ([], [11], [11, 12, 99], [99, 12], chain, chain[:3] + [7, 15])] == \
        [0, 1, 2, 0, 5, 3]


def test_the_provider_is_the_transfer_bringing_most_past_what_is_cached():
    req = ask("b", [1, 2, 3, 4])
    flying = [("x", [1, 2, 9]), ("y", [1, 2, 3, 4, 5]), ("b", [1, 2, 3, 4]), ("z", [7, 2, 3])]
    assert best_provider(req, flying, cached=0) == ("y", 4)
    assert best_provider(req, flying, cached=4) is None  # the cache holds all of it already
    # one block is always sent: a prompt of exactly four full blocks can reuse three
    assert best_provider(ask("b", [1, 2, 3, 4], num_tokens=4 * BLOCK), flying, cached=0) == ("y", 3)
    assert best_provider(ask("b", []), flying, cached=0) is None  # an ask offering no hashes


def test_a_held_ask_is_answered_ready_once_its_transfer_landed_and_its_blocks_are_cached():
    held = HeldAsks(grant_ttl_s=10.0)
    flying = {"m": [("a", [1, 2, 3])]}
    assert held.hold(b"p", ask("b", [1, 2, 3]), flying["m"], lambda: 0)
    assert not list(held.due(flying.get, lambda req: 0))  # still in flight
    flying["m"] = []  # landed: its blocks are cached
    (due,) = held.due(flying.get, lambda req: 3)
    assert due.req.request_id == "b" and due.state is HoldState.READY and not held


def test_a_held_ask_whose_transfer_failed_waits_for_another_in_flight_else_goes_unblocked():
    held = HeldAsks(grant_ttl_s=10.0)
    flying = {"m": [("a", [1, 2, 3])]}
    assert held.hold(b"p", ask("b", [1, 2, 3]), flying["m"], lambda: 0)
    flying["m"] = [("c", [1, 2])]  # a failed; c, granted since, brings two blocks
    assert not list(held.due(flying.get, lambda req: 0)) and held.asks["b"].provider == "c"
    flying["m"] = []  # c failed too
    (due,) = held.due(flying.get, lambda req: 0)
    assert due.state is HoldState.UNBLOCKED


def test_no_ask_is_held_past_its_bound_nor_twice_and_its_asker_may_cancel_it():
    held = HeldAsks(grant_ttl_s=8.0)
    ended = []
    held.on_end = lambda model, outcome, held_s: ended.append((model, outcome, held_s))
    flying = {"m": [("a", [1, 2, 3])]}
    before = time.monotonic()
    assert held.hold(b"p", ask("b", [1, 2, 3]), flying["m"], lambda: 0)
    assert before + 2.0 <= held.asks["b"].until <= time.monotonic() + 2.0  # a quarter of the grant TTL
    held.asks["b"].until = time.monotonic() - 1  # its bound passed, its transfer still in flight
    (due,) = held.due(flying.get, lambda req: 0)
    assert due.state is HoldState.UNBLOCKED
    assert held.hold(b"p", ask("c", [1, 2, 3]), flying["m"], lambda: 0)
    assert held.asked_again("c") and not held and not held.asked_again("c")
    assert held.hold(b"p", ask("d", [1, 2, 3]), flying["m"], lambda: 0)
    assert not held.cancel(b"other", "d") and held.cancel(b"p", "d") and not held
    assert held.outcomes == {HoldState.HELD: 3, HoldState.UNBLOCKED: 1, HoldState.DROPPED: 2}
    # each told as it ended, in order, with how long it was held
    assert [(model, outcome) for model, outcome, _ in ended] == [("m", "unblocked"), ("m", "dropped"), ("m", "dropped")]
    assert all(0 <= held_s <= time.monotonic() - before for _, _, held_s in ended)


def test_the_metrics_label_every_state_a_held_ask_ends_in_and_no_other():
    assert set(OUTCOMES) == {s.value for s in HoldState if s is not HoldState.HELD}
