"""Tells waiting requests when their queued jobs may be gone because Redis restarted or went away.

A job sits in the Redis stream until a worker reads it. Our Redis keeps no data across a restart, so a
job queued before the restart and not yet read is lost, and the request waiting for it would only end at
its deadline (minutes). This task notices, at most ``interval`` late, either:
  * a new Redis ``run_id`` (the server restarted), or
  * Redis unreachable for longer than ``outage_s``,
and bumps ``epoch``, with ``lost_before`` the moment from which Redis is known good again: when the
outage began, as first reported (a job queued, its XADD answered, after that went to the Redis that
came back), or now for a restart no command saw. A request whose jobs were queued before it
(``lost(queued_at)``) and which has heard nothing from any worker then ends with 503 + Retry-After
(``Generation``): a fast, retryable answer instead of a hang. A request a worker already answers is
unaffected: the worker holds it, not Redis; nor is one queued in the Redis that came back, though the
watch may notice the restart only after it queued.

It is also the gateway's Redis prober: its ``health`` (``RedisHealth``) is what ``/health`` answers
from, without a round trip of its own, and what every other part of the gateway reports outage errors
to (``redis_failed``), so an outage is logged once when it starts and once when it ends. When Redis is
back, or is a new server, the ``on_back`` callbacks publish again what the gateway keeps there (its
liveness key, the metrics salt).
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis
import redis.asyncio
from aiohttp import web

from kvrelay.gateway.tasks import cancel_and_wait
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger("kvrelay.gateway")


class RedisWatch:
    def __init__(self, client: redis.asyncio.Redis, interval: float, outage_s: float):
        self._redis = client
        self._interval = interval
        self._outage_s = outage_s
        self.epoch = 0
        self.lost_before = float("-inf")  # monotonic: jobs queued before it may be gone
        self._changed_at = float("-inf")  # monotonic time of the last epoch change
        self.run_id: str | None = None  # the server's, at the last probe
        self._outage_counted = False
        self._task: asyncio.Task | None = None
        self.health = RedisHealth(log)
        self.on_back: list[Callable[[], Awaitable[None]]] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvrelay-redis-watch")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    def _bump(self, lost_before: float) -> None:
        self.epoch += 1
        self._changed_at = time.monotonic()
        self.lost_before = max(self.lost_before, lost_before)

    def lost(self, queued_at: float) -> bool:
        """Whether jobs whose XADD was answered at ``queued_at`` (monotonic) may be gone."""
        return queued_at < self.lost_before

    @property
    def settling(self) -> bool:
        """Shortly after a restart or outage, a worker missing from Redis may just not have re-registered
        yet (they retry within a fraction of a second, but a heartbeat TTL is the safe bound)."""
        return time.monotonic() - self._changed_at < keys.HEARTBEAT_TTL_S

    async def check(self) -> None:
        """One probe; public so tests can step it."""
        try:
            run_id = (await self._redis.info("server")).get("run_id")
        except (redis.RedisError, OSError) as exc:  # a Redis refusing INFO is as unusable as a dead one
            self.health.failed(exc)
            down_for = self.health.down_for()
            if not self._outage_counted and down_for >= self._outage_s:
                self._outage_counted = True
                self._bump(self.health.down_since or time.monotonic())
                log.warning("redis down for %.1fs: failing requests still queued there", down_for)
            return
        began = self.health.down_since  # ok() forgets it
        back = self.health.ok()
        self._outage_counted = False
        if isinstance(run_id, bytes):
            run_id = run_id.decode()
        restarted = self.run_id is not None and run_id != self.run_id
        if restarted:
            self._bump(began if began is not None else time.monotonic())
            log.warning("redis restarted (run_id %s -> %s): jobs it had not saved are gone", self.run_id, run_id)
        self.run_id = run_id
        if back or restarted:
            for publish in self.on_back:
                try:
                    await publish()
                except (redis.RedisError, OSError) as exc:  # down again: the next recovery runs them again
                    if not self.health.absorb(exc):
                        log.warning("could not publish again after the redis restart: %s", exc)

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._interval)


REDIS_WATCH = web.AppKey("redis_watch", RedisWatch)


def redis_failed(app: web.Application, exc: BaseException) -> bool:
    """Report a Redis error of any part of the gateway: True when it is an outage, which the watch logs
    once (the caller then says nothing); False for any other error, the caller's to log."""
    return app[REDIS_WATCH].health.absorb(exc)
