"""Token events back to the gateways: one TokenBatch per gateway per step, over one ZMQ PUSH socket per
gateway address, sent without ever blocking the engine loop."""

import logging
import time

import zmq

from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import TokenBatch, TokenEvent
from kvrelay.shared.wire.zmq_auth import CurveKeys
from kvrelay.shared.worker.link_watch import LinkWatch

log = logging.getLogger(__name__)

EVENT_HWM = 1000  # TokenBatches a gateway may be behind before it counts as not reading


class EventSink:
    """Batches TokenEvents per gateway address and sends one TokenBatch per gateway per step, never
    blocking the step: a gateway that does not take its batch (dead, or EVENT_HWM batches behind) loses
    it, and ``take_stalled`` names it so that its requests, whose streams now have a gap, are aborted.
    Nobody else waits for it. A gateway whose connection closed (its process ended) is named by
    ``take_lost`` (link_watch.py)."""

    def __init__(self, ctx: zmq.Context, *, curve: CurveKeys | None):
        self.ctx, self.curve = ctx, curve
        self.sockets: dict[str, zmq.Socket] = {}
        self.pending: dict[str, list[TokenEvent]] = {}
        self._stalled: set[str] = set()
        self.links = LinkWatch()

    def add(self, reply_addr: str, event: TokenEvent) -> None:
        self.pending.setdefault(reply_addr, []).append(event)

    def dial(self, reply_addr: str) -> None:
        """Opens the connection to a gateway that events are about to go to, so the first of them does not
        wait on the handshake while messages on connections already up overtake it."""
        self._socket(reply_addr)

    def flush(self) -> None:
        now = time.time()
        for addr, events in self.pending.items():
            for event in events:
                if event.first_token_times is not None:  # the end of the first token's way through the worker
                    event.first_token_times["flushed"] = now
            try:
                self._socket(addr).send(encode(TokenBatch(events=events)), zmq.NOBLOCK)
            except zmq.Again:
                if addr not in self._stalled:
                    log.warning("gateway %s is not reading; dropped %d events", addr, len(events))
                self._stalled.add(addr)
        self.pending.clear()

    def _socket(self, addr: str) -> zmq.Socket:
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.sockets[addr] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, EVENT_HWM)
            zmq_auth.dial(sock, self.curve)
            self.links.add(addr, sock)
            sock.connect(addr)
        return sock

    def take_stalled(self) -> list[str]:
        stalled, self._stalled = list(self._stalled), set()
        return stalled

    def take_lost(self) -> list[str]:
        return self.links.take_lost()

    def reached(self, addr: str) -> bool:
        return self.links.reached(addr)

    def forget(self, addr: str) -> None:
        """Its requests are gone: drop what it has not taken and the connection (a new one is made if
        events for it come again)."""
        self.pending.pop(addr, None)
        sock = self.sockets.pop(addr, None)
        if sock is not None:
            self.links.remove(addr, sock)
            sock.close(linger=0)

    def close(self) -> None:
        for addr, sock in self.sockets.items():
            self.links.remove(addr, sock)
            sock.close()
