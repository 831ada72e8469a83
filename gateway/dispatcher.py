"""The gateway's one ZMQ PULL socket: every worker PUSHes TokenBatches here (the Jobs' ``reply_addr``),
and one task routes each event to the queue of the request waiting for it.

Events for ids nobody waits on (finished, aborted, a duplicate delivery of a re-run job) are dropped:
a client never sees a second stream for one request.
"""

import asyncio
import logging

import zmq
import zmq.asyncio

from kvrelay.gateway.tasks import cancel_and_wait
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.limits import MAX_MESSAGE_BYTES
from kvrelay.shared.wire.protocol import TokenBatch, TokenEvent
from kvrelay.shared.wire.zmq_auth import CurveKeys

log = logging.getLogger("kvrelay.gateway")


class Dispatcher:
    def __init__(self, bind_host: str, port: int, advertise_host: str, *, curve: CurveKeys | None):
        self._curve = curve  # workers present the deployment's keys; nobody else gets a message in
        self._bind_host = bind_host
        self._port = port
        self._advertise_host = advertise_host
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.address = ""
        self.dropped = 0  # events nobody waited for
        self.malformed = 0  # messages that failed protocol validation

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        # Oversized messages are cut off by libzmq before they reach Python.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        zmq_auth.serve(sock, self._curve)
        host = "*" if self._bind_host in ("0.0.0.0", "*") else self._bind_host
        if self._port:
            sock.bind(f"tcp://{host}:{self._port}")
            port = self._port
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self._sock = sock
        self.address = f"tcp://{self._advertise_host}:{port}"
        self._task = asyncio.create_task(self._run(), name="kvrelay-dispatcher")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def register(self, request_ids: list[str]) -> "asyncio.Queue[TokenEvent]":
        """One queue for all of a client request's job ids (its n choices), so one loop serves them."""
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        for rid in request_ids:
            if rid in self._queues:
                raise RuntimeError(f"request id {rid!r} is already registered")
        for rid in request_ids:
            self._queues[rid] = queue
        return queue

    def unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def _run(self) -> None:
        assert self._sock is not None
        while True:
            data = await self._sock.recv(copy=True)
            try:
                batch = decode(data, TokenBatch)
            except ValueError as exc:
                self.malformed += 1
                log.warning("dropping malformed TokenBatch (%d bytes): %s", len(data), exc)
                continue
            for event in batch.events:
                queue = self._queues.get(event.request_id)
                if queue is None:
                    self.dropped += 1
                else:
                    queue.put_nowait(event)
