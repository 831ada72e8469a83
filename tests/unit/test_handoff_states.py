"""shared/handoff/states.py: the transfer state table, every (state, event) pair of it."""

import itertools

import pytest

from kvrelay.shared.handoff.states import TRANSITIONS, Event, IllegalTransition, State, next_state

LEGAL = {
    (State.NEW, Event.ASK): State.GRANT_WAIT,
    (State.NEW, Event.PARK): State.PARKED,
    (State.NEW, Event.FAIL): State.FAILED,
    (State.GRANT_WAIT, Event.ASK): State.GRANT_WAIT,
    (State.GRANT_WAIT, Event.GRANTED): State.GRANTED,
    (State.GRANT_WAIT, Event.PARK): State.PARKED,
    (State.GRANT_WAIT, Event.SEND): State.SENDING,
    (State.GRANT_WAIT, Event.FAIL): State.FAILED,
    (State.GRANTED, Event.ASK): State.GRANT_WAIT,
    (State.GRANTED, Event.PARK): State.PARKED,
    (State.GRANTED, Event.STREAM): State.STREAMING,
    (State.GRANTED, Event.SEND): State.SENDING,
    (State.GRANTED, Event.FAIL): State.FAILED,
    (State.PARKED, Event.ASK): State.GRANT_WAIT,
    (State.PARKED, Event.FAIL): State.FAILED,
    (State.STREAMING, Event.SEND): State.SENDING,
    (State.STREAMING, Event.FAIL): State.FAILED,
    (State.SENDING, Event.KV_OUT): State.ACK_WAIT,
    (State.SENDING, Event.FAIL): State.FAILED,
    (State.ACK_WAIT, Event.ACK): State.DONE,
    (State.ACK_WAIT, Event.FAIL): State.FAILED,
}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)),
                         ids=lambda x: x.value)
def test_every_pair_is_legal_exactly_as_listed(state, event):
    if (state, event) in LEGAL:
        assert next_state(state, event) is LEGAL[state, event]
    else:
        with pytest.raises(IllegalTransition, match=f"{state.value} cannot take {event.value}"):
            next_state(state, event)


def test_the_table_is_the_listed_one_and_ends_are_final():
    assert TRANSITIONS == LEGAL
    assert not [key for key in TRANSITIONS if key[0] in (State.DONE, State.FAILED)]
    reachable, frontier = {State.NEW}, [State.NEW]  # no state the table cannot reach
    while frontier:
        here = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is here and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == set(State)
