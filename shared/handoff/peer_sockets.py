"""The prefill side's sockets to decode workers: one DEALER a decode worker, dialled on first use, polled
together with a ``Waker`` so layers staged by pool threads go out at once even when the loop is idle; and one
plain DEALER for each of a decode worker's bulk sockets (HandoffGrant.frames_addrs), which only sends: MAC'd
frames, each authenticated by its grant's key rather than by CURVE (shared/handoff/frames.py). Each is its own
connection, and the bulk ones take the context's I/O threads but the first in turn: libzmq would give each the
least busy thread as it connects, but a transfer opens its sockets all at once, before any is busy, and they
would share one."""

import itertools
from collections.abc import Iterator

import zmq

from kvrelay.shared.handoff import spin_poll
from kvrelay.shared.handoff.waker import Waker
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.limits import MAX_MESSAGE_BYTES
from kvrelay.shared.wire.zmq_auth import CurveKeys

SEND_HWM = 256  # queued messages per decode worker; bounds what a stalled peer can make us hold


class PeerSockets:
    def __init__(self, ctx: zmq.Context, curve: CurveKeys | None):
        self.ctx, self.curve = ctx, curve
        self.sockets: dict[str, zmq.Socket] = {}
        self.bulk: dict[str, zmq.Socket] = {}
        self._io_threads = ctx.get(zmq.IO_THREADS)
        self._bulk_opened = itertools.count()
        self.addr_of: dict[zmq.Socket, str] = {}  # a polled socket's decode worker: whose reply it carries
        self.poller = zmq.Poller()
        self.waker = Waker()
        self.poller.register(self.waker.fd, zmq.POLLIN)

    def close(self) -> None:
        for sock in (*self.sockets.values(), *self.bulk.values()):
            sock.close(linger=0)
        self.waker.close()

    def replies(self, timeout_ms: int, spin_s: float = 0.0) -> Iterator[tuple[str, list[bytes]]]:
        """Every reply that arrives within ``timeout_ms`` (or a wake-up ends the wait), one at a time, with the
        address of the decode worker that sent it; the first ``spin_s`` of the wait spin (spin_poll.py)."""
        for sock, _ in spin_poll.poll(self.poller, timeout_ms, spin_s):
            if sock == self.waker.fd:
                self.waker.drain()
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                yield self.addr_of[sock], frames

    def send(self, addr: str, parts: list, bulk: bool = False) -> bool:
        """Queue one message for the decode worker at ``addr`` (``bulk``: its plain bulk socket at ``addr``); False
        when its queue is full."""
        try:
            self._socket(addr, bulk).send_multipart(parts, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _socket(self, addr: str, bulk: bool) -> zmq.Socket:
        sockets = self.bulk if bulk else self.sockets
        sock = sockets.get(addr)
        if sock is None:
            sock = sockets[addr] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.AFFINITY, 1 << self._io_thread(bulk))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # replies are control messages only
            if not bulk:  # nothing comes back on the bulk one: not polled
                zmq_auth.dial(sock, self.curve)
                self.poller.register(sock, zmq.POLLIN)
                self.addr_of[sock] = addr
            sock.connect(addr)
        return sock

    def _io_thread(self, bulk: bool) -> int:
        """Thread 0 carries the control connections; the bulk ones take the others in turn (all of them share
        thread 0 in a context of one)."""
        if not bulk or self._io_threads == 1:
            return 0
        return 1 + next(self._bulk_opened) % (self._io_threads - 1)
