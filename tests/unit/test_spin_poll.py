"""spin_poll.poll: spins on poll(0) for its first spin_s, then blocks for what is left of the timeout; and the
handoff's two loops ask for the spin only while a reply is due."""

import threading
import time
from types import SimpleNamespace

import torch
import zmq

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.shared.engine import detached_kv
from kvrelay.shared.handoff import spin_poll
from kvrelay.shared.handoff.sender import HandoffSender
from kvrelay.shared.handoff.standalone import DetachedCore, serves
from kvrelay.shared.handoff.states import State
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffCancel, HandoffGrant, HandoffRequest


class Silent:
    """A poller that never has anything, recording each timeout it was polled with."""

    def __init__(self):
        self.calls = []

    def poll(self, timeout=None):
        self.calls.append(timeout)
        return []


def test_spins_then_blocks_for_the_rest_of_the_timeout():
    p = Silent()
    assert spin_poll.poll(p, 30, spin_s=0.005) == []
    spins, last = p.calls[:-1], p.calls[-1]
    assert spins and set(spins) == {0}  # every poll of the spin returns at once
    assert 20 <= last <= 25  # 30 ms less the ~5 ms spun


def test_no_spin_without_spin_s_or_timeout():
    for timeout, spin in ((30, 0.0), (0, 0.005)):
        p = Silent()
        spin_poll.poll(p, timeout, spin)
        assert p.calls == [timeout]
    p = Silent()
    spin_poll.poll(p, 2, 1.0)  # the spin never outlasts the timeout
    assert p.calls[-1] == 0


def test_a_message_during_the_spin_is_returned():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://spin-poll-test")
    b.connect("inproc://spin-poll-test")
    poller = zmq.Poller()
    poller.register(a, zmq.POLLIN)
    sender = threading.Thread(target=lambda: (time.sleep(0.002), b.send(b"x")))
    sender.start()
    ready = spin_poll.poll(poller, 5_000, spin_s=5.0)
    sender.join()
    assert dict(ready).get(a) == zmq.POLLIN and a.recv() == b"x"
    a.close(linger=0)
    b.close(linger=0)


def _transfers(*states_and_targets):
    return SimpleNamespace(transfers={str(i): SimpleNamespace(state=s, target=t)
                                      for i, (s, t) in enumerate(states_and_targets)})


def test_the_sender_spins_only_while_an_answer_or_an_ack_is_due():
    due = HandoffSender._reply_due
    assert due(_transfers((State.GRANT_WAIT, "tcp://d1")))
    assert due(_transfers((State.SENDING, "tcp://d1"), (State.ACK_WAIT, "tcp://d1")))
    # no ask out (waiting for a decode worker to register), parked, granted early, or streaming: nothing is due
    assert not due(_transfers((State.GRANT_WAIT, ""), (State.PARKED, ""), (State.GRANTED, "tcp://d1"),
                              (State.STREAMING, "tcp://d1")))
    assert not due(_transfers())


def test_the_decode_side_spins_only_while_it_holds_a_grant():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    core = DetachedCore(detached_kv(torch.zeros(1, 2, 16, 4, 1, 4)), max_model_len=64)
    receiver = HandoffReceiver(sock, serves("tiny", core), grant_ttl_s=30.0)
    spins = []
    messages = receiver.socket.messages
    receiver.socket.messages = lambda timeout_ms, spin_s=0.0: spins.append(spin_s) or messages(timeout_ms, spin_s)
    asker = ctx.socket(zmq.DEALER)
    asker.connect(addr)
    try:
        receiver.poll(1, admit=lambda header: None)
        assert spins[-1] == 0.0
        asker.send(encode(HandoffRequest("r1", "tiny", num_tokens=8, block_size=4, tenant="t")))
        while not asker.poll(10):
            receiver.poll(10, admit=lambda header: None)
        assert decode(asker.recv(), HandoffGrant).accepted
        receiver.poll(1, admit=lambda header: None)
        assert spins[-1] == spin_poll.REPLY_SPIN_S  # its KV and header are due
        asker.send(encode(HandoffCancel("r1")))
        while "r1" in receiver.grants:
            receiver.poll(10, admit=lambda header: None)
        receiver.poll(1, admit=lambda header: None)
        assert spins[-1] == 0.0
    finally:
        ctx.destroy(linger=0)
