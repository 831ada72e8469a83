"""Which gateways' event connections are down, as ZMQ's socket monitors say: a gateway process that ends
(killed with -9, crashed, restarted) closes the TCP connection of its PULL socket at once, while its
liveness key outlives it by up to GATEWAY_TTL_S. Without this, a dead gateway's requests would keep their
decode seats and KV for those seconds, and every other gateway's requests would wait for them.

An address whose connection is down, or was never made, for LOST_AFTER_S is reported lost, once per
outage. ZMQ redials a dropped connection every 100 ms, so a live gateway is back well within that; a
gateway whose host vanished without closing anything is found by its liveness key instead
(gateway_watch.py)."""

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

LOST_AFTER_S = 0.5
_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class LinkWatch:
    def __init__(self) -> None:
        self._monitors: dict[str, zmq.Socket] = {}
        self._down_since: dict[str, float] = {}  # address -> monotonic time its connection went (or was dialed)
        self._reported: set[str] = set()  # down and already reported: not again until it comes back
        self._reached: set[str] = set()  # connected at least once since it was added

    def add(self, addr: str, sock: zmq.Socket) -> None:
        """Watch ``sock`` (call before it connects, so its first connection is seen)."""
        self._monitors[addr] = sock.get_monitor_socket(_EVENTS)
        self._down_since[addr] = time.monotonic()
        self._reached.discard(addr)

    def remove(self, addr: str, sock: zmq.Socket) -> None:
        mon = self._monitors.pop(addr, None)
        if mon is not None:
            sock.disable_monitor()
            mon.close(linger=0)
        self._down_since.pop(addr, None)
        self._reported.discard(addr)
        self._reached.discard(addr)

    def reached(self, addr: str) -> bool:
        """Whether its connection was ever up (a lost one that never was may be a live gateway not yet dialed
        through, on a loaded box)."""
        return addr in self._reached

    def take_lost(self) -> list[str]:
        """Addresses down for LOST_AFTER_S since the last report; never blocks."""
        now = time.monotonic()
        lost = []
        for addr, mon in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_CONNECTED:
                    self._reached.add(addr)
                    self._down_since.pop(addr, None)
                    self._reported.discard(addr)
                elif event == zmq.EVENT_DISCONNECTED:
                    self._down_since.setdefault(addr, now)
            since = self._down_since.get(addr)
            if since is not None and now - since >= LOST_AFTER_S and addr not in self._reported:
                self._reported.add(addr)
                lost.append(addr)
        return lost
