"""The decode side's socket: the ROUTER that prefill workers' asks, KV and cancels arrive on and replies leave
from, polled together with a ``Waker`` and the sockets the transfers in flight wait on (``KVReceiver.wakes_on``:
a sharded worker's ranks' reports), so writes finished by pool threads and shares taken by other ranks are
acked at once even when the loop is idle. With bulk sockets (plain: host-staged frames MAC'd under their grant's
key arrive there, frames.py) those are polled too."""

from collections.abc import Iterator

import zmq

from kvrelay.shared.handoff import spin_poll
from kvrelay.shared.handoff.waker import Waker
from kvrelay.shared.wire.codec import encode


class InboxSocket:
    def __init__(self, sock: zmq.Socket, bulk: list[zmq.Socket] | None = None):
        self.sock, self.bulk = sock, list(bulk or ())
        self.waker = Waker()
        self.poller = zmq.Poller()
        for s in (sock, *self.bulk):
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self._watched: set[zmq.Socket] = set()

    def watch(self, sockets: set[zmq.Socket]) -> None:
        """From now on a message on any of ``sockets`` ends the wait too (and none on those watched until now)."""
        for sock in self._watched - sockets:
            self.poller.unregister(sock)
        for sock in sockets - self._watched:
            self.poller.register(sock, zmq.POLLIN)
        self._watched = sockets

    def messages(self, timeout_ms: int, spin_s: float = 0.0) -> Iterator[tuple[list, bool]]:
        """Every message that arrives within ``timeout_ms`` (or a wake-up, or a watched socket's message, ends
        the wait), one at a time, each with whether it came on a bulk socket; the first ``spin_s`` of the wait
        spin (spin_poll.py)."""
        ready = dict(spin_poll.poll(self.poller, timeout_ms, spin_s))
        if self.waker.fd in ready:
            self.waker.drain()
        for sock in (self.sock, *self.bulk):
            while sock in ready:
                try:
                    yield sock.recv_multipart(zmq.NOBLOCK, copy=False), sock is not self.sock
                except zmq.Again:
                    break

    def reply(self, peer: bytes, msg) -> bool:
        """Queue ``msg`` for the prefill worker at ``peer``; False when its queue is full."""
        try:
            self.sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
