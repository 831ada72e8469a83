"""A gateway whose process ends closes its event connection at once: the worker's LinkWatch names it lost
within LOST_AFTER_S (its liveness key would take GATEWAY_TTL_S), once per outage; a gateway whose
connection comes back within that, and a live one, are never named."""

import contextlib
import time
from types import SimpleNamespace

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvrelay.shared.worker import link_watch
from kvrelay.shared.worker.link_watch import LinkWatch

BOUND_S = 60.0  # a hang bound, not a speed claim; the watch itself reports after LOST_AFTER_S


def _quiet_until(watch: LinkWatch, done, what: str) -> None:
    """Has the watch take its events until ``done()``; its clock stands still meanwhile, so nothing may be
    named lost."""
    deadline = time.monotonic() + BOUND_S
    while True:
        assert watch.take_lost() == []
        if done():
            return
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _test_clock(monkeypatch) -> list[float]:
    """The watch's clock, as the test moves it: no time passes for the watch while a loaded box is slow to
    connect, close or deliver a monitor event; only what the test adds."""
    clock = [0.0]
    monkeypatch.setattr(link_watch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return clock


def test_a_closed_connection_is_lost_once_a_live_one_never_and_a_redial_that_finds_nobody_too(monkeypatch):
    clock = _test_clock(monkeypatch)
    events: list[int] = []  # every monitor event the watch has taken

    def taken(mon: zmq.Socket, flags: int = 0) -> dict:
        msg = recv_monitor_message(mon, flags)
        events.append(msg["event"])
        return msg

    monkeypatch.setattr(link_watch, "recv_monitor_message", taken)
    ctx = zmq.Context()
    gateways = {name: ctx.socket(zmq.PULL) for name in ("live", "dies")}
    addrs = {name: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for name, s in gateways.items()}
    watch = LinkWatch()
    pushes = {}
    for name, addr in addrs.items():
        pushes[name] = ctx.socket(zmq.PUSH)
        watch.add(addr, pushes[name])
        pushes[name].connect(addr)
    nobody = "tcp://127.0.0.1:9"  # discard port: nothing listens there
    pushes["nobody"] = ctx.socket(zmq.PUSH)
    watch.add(nobody, pushes["nobody"])
    pushes["nobody"].connect(nobody)
    try:
        _quiet_until(watch, lambda: all(watch.reached(a) for a in addrs.values()), "the gateways never connected")
        clock[0] += link_watch.LOST_AFTER_S
        assert watch.take_lost() == [nobody]  # dialed and never connected
        clock[0] += 10 * link_watch.LOST_AFTER_S
        assert watch.take_lost() == []  # named once, and both gateways are connected
        gateways["dies"].close(linger=0)  # as its process ending does
        # the only connection that was up and drops: the closed one
        _quiet_until(watch, lambda: zmq.EVENT_DISCONNECTED in events, "the closed connection never dropped")
        dropped = clock[0]
        clock[0] = dropped + link_watch.LOST_AFTER_S / 2
        assert watch.take_lost() == []  # not within the grace
        clock[0] = dropped + link_watch.LOST_AFTER_S
        assert watch.take_lost() == [addrs["dies"]]
        clock[0] += 10 * link_watch.LOST_AFTER_S
        assert watch.take_lost() == []  # once per outage, though ZMQ keeps redialling it
    finally:
        for name, addr in [*addrs.items(), ("nobody", nobody)]:
            watch.remove(addr, pushes[name])  # its monitor socket too, or the context never terminates
        for s in [*pushes.values(), *gateways.values()]:
            s.close(linger=0)
        ctx.term()


def _bind_when_free(sock: zmq.Socket, addr: str, within: float) -> None:
    # a closed socket's port is released by ZMQ's I/O thread, later on a loaded box
    deadline = time.monotonic() + within
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _delivered(push: zmq.Socket, pull: zmq.Socket) -> None:
    """Returns once a message goes through: the connection is up. Sent again until one does: one sent
    before the push side saw the old connection go is lost with it."""
    deadline = time.monotonic() + BOUND_S
    while True:
        with contextlib.suppress(zmq.Again):
            push.send(b"ping", zmq.NOBLOCK)
        if pull.poll(100):
            assert pull.recv() == b"ping"
            return
        assert time.monotonic() < deadline, "the connection never came up"


def test_a_gateway_back_on_its_address_within_the_grace_is_not_lost(monkeypatch):
    # no time passes for the watch while this box releases and re-binds the port, then far more than the
    # grace; what is checked is that a redial within the grace is not named lost
    clock = _test_clock(monkeypatch)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    push = ctx.socket(zmq.PUSH)
    watch = LinkWatch()
    watch.add(addr, push)
    push.connect(addr)
    try:
        _delivered(push, pull)
        assert watch.take_lost() == []
        pull.close(linger=0)
        pull = ctx.socket(zmq.PULL)
        _bind_when_free(pull, addr, within=BOUND_S)  # a restart on the same address
        _delivered(push, pull)  # ZMQ redialled it
        assert watch.take_lost() == []
        clock[0] += 10 * link_watch.LOST_AFTER_S
        assert watch.take_lost() == []
    finally:
        watch.remove(addr, push)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
