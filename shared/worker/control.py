"""The model control plane as a worker sees it: load/unload commands arrive on the worker's Redis list
(``control_key``) and go to the model host's queue; their results go back under ``control_result_key``.
The listener runs on its own thread and only talks to Redis; the host acts on commands in the main loop."""

import logging
import queue
import threading
from collections.abc import Callable

import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult, ModelSpec
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger(__name__)


class ControlChannel:
    def __init__(self, redis_client: redis.Redis, worker_id: str, on_result: Callable[[], None],
                 health: RedisHealth | None = None):
        """``on_result``: called after each result is reported (what the worker advertises changed)."""
        self.redis = redis_client
        self.health = health or RedisHealth(log)
        self.worker_id = worker_id
        self.on_result = on_result

    def listen(self, stop: threading.Event, commands: queue.Queue[ControlCommand]) -> None:
        """Load/unload commands from ``control_key(worker_id)`` into ``commands``, until ``stop``."""
        key = keys.control_key(self.worker_id)
        while not stop.is_set():
            try:
                item = self.redis.brpop([key], timeout=1)
            except redis.RedisError as exc:
                if not self.health.absorb(exc):
                    log.warning("control listener lost Redis (%s); retrying", exc)
                stop.wait(1.0)
                continue
            if item is None:
                continue
            try:
                commands.put(decode(item[1], ControlCommand))
            except ValueError as exc:
                log.warning("dropped a malformed control command: %s", exc)

    def report(self, result: ControlResult) -> None:
        result.worker_id = self.worker_id
        try:
            self.redis.set(keys.control_result_key(result.command_id), encode(result),
                           ex=keys.CONTROL_RESULT_TTL_S)
        except redis.RedisError as exc:
            self.health.absorb(exc)
            log.warning("could not report the result of command %s: %s", result.command_id, exc)
        self.on_result()

    def min_replicas(self, name: str) -> int:
        try:
            raw = self.redis.get(keys.registry_key(name))
            return decode(raw, ModelSpec).min_replicas if raw else 0
        except (redis.RedisError, ValueError):
            return 1  # unknown: do not unload on a guess

    def close(self) -> None:
        """Drop commands nobody will read: placement must not wait on them."""
        try:
            self.redis.delete(keys.control_key(self.worker_id))
        except redis.RedisError:
            pass
