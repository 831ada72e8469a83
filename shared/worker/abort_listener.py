"""Aborts published by gateways (client gone, deadline passed) on ``ABORT_CHANNEL``: a thread subscribes
and queues the request ids; the main loop takes them (``drain``) and ends whichever of them it holds."""

import logging
import queue
import threading

import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import Abort
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger(__name__)


class AbortListener:
    def __init__(self, redis_client: redis.Redis, health: RedisHealth | None = None):
        self.redis = redis_client
        self.health = health or RedisHealth(log)
        self.ids: queue.Queue[str] = queue.Queue()

    def run(self, stop: threading.Event) -> None:
        """The subscription thread, until ``stop``; a lost subscription is made again."""
        while not stop.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.ABORT_CHANNEL)
                while not stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg["type"] == "message":
                        try:
                            for rid in decode(msg["data"], Abort).request_ids:
                                self.ids.put(rid)
                        except ValueError:
                            log.warning("dropped a malformed abort message")
            except redis.RedisError as exc:
                if not self.health.absorb(exc):
                    log.warning("abort subscription lost (%s); retrying", exc)
                stop.wait(1.0)

    def drain(self) -> list[str]:
        """The request ids aborted since the last call."""
        ids = []
        while True:
            try:
                ids.append(self.ids.get_nowait())
            except queue.Empty:
                return ids
