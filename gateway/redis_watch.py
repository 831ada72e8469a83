"""Tells waiting requests when their queued jobs are gone because Redis restarted or went away.

A job sits in the Redis stream until a worker reads it. A Redis that restarts may come back without it
(empty, or without the last second its append-only file had not written), and the request waiting for
it would only end at its deadline (minutes). This task notices, at most ``interval`` late, either:
  * a new Redis ``run_id`` (the server restarted): it asks the new server which of the jobs queued
    before (``queued``, ``QueuedJobs``: one round trip for all of them) it still holds; a request with
    one gone fails, the others wait for a worker to read their jobs, or
  * Redis unreachable for longer than ``outage_s``: nothing can be asked, so ``lost_before`` becomes
    the moment the outage began (as first reported), and every request whose jobs were queued before it
    (``lost(queued_at)``) and from which no worker was heard fails.
Failing is 503 + Retry-After (``Generation``): a fast, retryable answer instead of a hang. A request a
worker already answers is unaffected: the worker holds it, not Redis; nor is one queued in the Redis
that came back (its XADD answered after the outage began), though the watch may notice the restart only
after it queued. A restart check that Redis keeps failing is given up after ``outage_s``, and its
requests fail as after an outage.

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

from kvrelay.gateway.queued_jobs import QueuedJobs
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
        self.queued = QueuedJobs(client)
        # after a restart: jobs queued before this (monotonic) are to be looked for in the new server
        self._recheck_before: float | None = None
        self._recheck_due_at = 0.0  # monotonic, when that check became due
        self._rechecking = False
        self._task: asyncio.Task | None = None
        self.health = RedisHealth(log)
        self.on_back: list[Callable[[], Awaitable[None]]] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvrelay-redis-watch")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    def _bump(self, lost_before: float | None) -> None:
        self.epoch += 1
        self._changed_at = time.monotonic()
        if lost_before is not None:
            self.lost_before = max(self.lost_before, lost_before)

    def lost(self, queued_at: float) -> bool:
        """Whether jobs whose XADD was answered at ``queued_at`` (monotonic) may be gone: an outage too
        long to wait out began after it."""
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
            self._bump(None)
            if self._recheck_before is None:
                self._recheck_due_at = time.monotonic()
            self._recheck_before = max(self._recheck_before or float("-inf"),
                                       began if began is not None else time.monotonic())
            log.warning("redis restarted (run_id %s -> %s): looking for the queued jobs in the new server",
                        self.run_id, run_id)
        self.run_id = run_id
        await self._recheck()
        if back or restarted:
            for publish in self.on_back:
                try:
                    await publish()
                except (redis.RedisError, OSError) as exc:  # down again: the next recovery runs them again
                    if not self.health.absorb(exc):
                        log.warning("could not publish again after the redis restart: %s", exc)

    async def _recheck(self) -> None:
        """The due restart check, at most one at a time (a request handler may probe too); a failed one is
        tried again at the next probe, and given up after ``outage_s``: then its requests count as lost."""
        before = self._recheck_before
        if before is None or self._rechecking:
            return
        self._rechecking = True
        try:
            await self.queued.recheck(before)
        except (redis.RedisError, OSError) as exc:
            if not self.health.absorb(exc):
                log.warning("could not look for the queued jobs in the restarted redis: %s", exc)
            if time.monotonic() - self._recheck_due_at >= self._outage_s:
                log.warning("redis restarted %.1fs ago and cannot say which jobs it kept: failing the requests "
                            "queued before", time.monotonic() - self._recheck_due_at)
                self._bump(before)
                if self._recheck_before == before:
                    self._recheck_before = None
            return
        finally:
            self._rechecking = False
        if self._recheck_before == before:  # no later restart asked for a wider check meanwhile
            self._recheck_before = None

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._interval)


REDIS_WATCH = web.AppKey("redis_watch", RedisWatch)


def redis_failed(app: web.Application, exc: BaseException) -> bool:
    """Report a Redis error of any part of the gateway: True when it is an outage, which the watch logs
    once (the caller then says nothing); False for any other error, the caller's to log."""
    return app[REDIS_WATCH].health.absorb(exc)
