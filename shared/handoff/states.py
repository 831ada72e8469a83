"""The prefill side's state table for one KV transfer: every state, every event, and nothing else.

    NEW --ask--> GRANT_WAIT --send--> SENDING --kv_out--> ACK_WAIT --ack--> DONE
    GRANT_WAIT --ask--> GRANT_WAIT     refused or unanswered: the next decode worker (none with room: all again)
An early ask (the prompt not computed yet) may instead go
    GRANT_WAIT --granted--> GRANTED --stream--> STREAMING --send (first token)--> SENDING
    GRANTED --send--> SENDING          the prefill ended with the grant still fresh
    GRANTED --ask--> GRANT_WAIT        ... or stale: cancelled and asked again
    NEW, GRANT_WAIT, GRANTED --park--> PARKED --ask (once computed)--> GRANT_WAIT
and every state but DONE and FAILED --fail--> FAILED (a nack, a timeout past the retries, a cancel).

A transition the table does not name raises ``IllegalTransition``: the mechanics (sender.py) move a
transfer only through ``Transfer.to`` (SGLang's KVPoll is the model: one poll state per transfer).
"""

import enum


class State(enum.Enum):
    NEW = "new"
    GRANT_WAIT = "grant_wait"  # a HandoffRequest is out (or we wait for a decode worker with room)
    GRANTED = "granted"  # early: blocks reserved on the decode side, the prompt not computed yet
    PARKED = "parked"  # early ask refused, unanswered or stale: asks again once computed
    STREAMING = "streaming"  # KV leaving while the last chunk computes; no first token yet
    SENDING = "sending"  # KV leaving after the prefill; the header follows it
    ACK_WAIT = "ack_wait"  # header out: the decode side checks and admits
    DONE = "done"
    FAILED = "failed"


class Event(enum.Enum):
    ASK = "ask"  # a HandoffRequest was queued (sent with the step's others), or a wait for room began
    GRANTED = "granted"  # an accepted grant for a prompt not computed yet
    PARK = "park"  # an early ask refused, unanswered or gone stale: ask again once computed
    STREAM = "stream"  # the forward computing the prompt's last chunk starts, holding a fresh grant
    SEND = "send"  # the KV moves after the prefill (a grant for a computed prompt, or a streamed one's first token)
    KV_OUT = "kv_out"  # every byte of KV out, the header sent
    ACK = "ack"  # the decode side admitted the request
    FAIL = "fail"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.ASK): State.GRANT_WAIT,
    (State.NEW, Event.PARK): State.PARKED,
    (State.GRANT_WAIT, Event.ASK): State.GRANT_WAIT,
    (State.GRANT_WAIT, Event.GRANTED): State.GRANTED,
    (State.GRANT_WAIT, Event.PARK): State.PARKED,
    (State.GRANT_WAIT, Event.SEND): State.SENDING,
    (State.GRANTED, Event.ASK): State.GRANT_WAIT,  # the grant went stale before the prompt was done
    (State.GRANTED, Event.PARK): State.PARKED,
    (State.GRANTED, Event.STREAM): State.STREAMING,
    (State.GRANTED, Event.SEND): State.SENDING,
    (State.PARKED, Event.ASK): State.GRANT_WAIT,
    (State.STREAMING, Event.SEND): State.SENDING,
    (State.SENDING, Event.KV_OUT): State.ACK_WAIT,
    (State.ACK_WAIT, Event.ACK): State.DONE,
    **{(s, Event.FAIL): State.FAILED for s in State if s not in (State.DONE, State.FAILED)},
}


class IllegalTransition(RuntimeError):
    pass


def next_state(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(f"a transfer in {state.value} cannot take {event.value}") from None
