"""Moves the pool toward the registry's desired state, in the background, one gateway at a time.

Every ``reconcile_interval_s`` the gateway that wins a short Redis lock:
  * loads pinned models and those with ``min_replicas`` > 0 wherever they are missing (after a worker
    restart, a registration whose first load failed, ...);
  * clears a finished swap's ``previous_version`` once no worker holds the old instance any more;
  * gives a model record that no live worker holds and that has no TTL (written by an older kvrelay) the
    TTL its workers would have given it (model_record_ttl.py).
Beside it, every gateway prewarms the models whose queues hold jobs while no worker holds them
(prewarm.py).
Overlapping runs (a lock that lapsed during a long load) are harmless: the loads themselves take the
per-instance load lock (placement.py).
"""

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

import redis
import redis.asyncio
from aiohttp import web

from kvrelay.gateway.control.model_record_ttl import expire_unheld_records
from kvrelay.gateway.control.model_registry import MODEL_REGISTRY, ModelRegistry, SpecConflict
from kvrelay.gateway.control.placement import PLACEMENT, LoadError, Placement, instance_state
from kvrelay.gateway.control.prewarm import PREWARM_EVERY_S, Prewarmer
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY, WorkerRegistry
from kvrelay.gateway.redis_watch import REDIS_WATCH
from kvrelay.gateway.state import CONFIG, REDIS
from kvrelay.gateway.tasks import cancel_and_wait
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.protocol import ModelSpec, instance_key
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger("kvrelay.gateway")

RECONCILE_LOCK = keys.RECONCILE_LOCK


class Reconciler:
    def __init__(self, client: redis.asyncio.Redis, models: ModelRegistry, placement: Placement,
                 registry: WorkerRegistry, interval_s: float, load_timeout: float,
                 health: RedisHealth | None = None):
        self._redis = client
        self._health = health or RedisHealth(log)
        self._models = models
        self._placement = placement
        self._registry = registry
        self._interval_s = interval_s
        self._load_timeout = load_timeout

    async def run_once(self) -> bool:
        """One pass if this gateway wins the lock; public so tests can step it. True if it ran."""
        token = uuid.uuid4().hex
        if not await self._redis.set(RECONCILE_LOCK, token, nx=True, ex=int(self._interval_s * 2) + 1):
            return False
        try:
            for spec in (await self._models.specs(fresh=True)).values():
                await self._reconcile(spec)
            for instance in await expire_unheld_records(self._redis, self._registry):
                log.info("%s: no live worker holds its record and it had no TTL: it expires in %d s",
                         instance, keys.MODEL_TTL_S)
        finally:
            if await self._redis.get(RECONCILE_LOCK) == token.encode():
                await self._redis.delete(RECONCILE_LOCK)
        return True

    async def _reconcile(self, spec: ModelSpec) -> None:
        if spec.pinned or spec.min_replicas > 0:
            try:
                await self._placement.ensure_loaded(spec, self._load_timeout, replicas=max(1, spec.min_replicas))
            except LoadError as exc:
                log.warning("cannot keep %s loaded: %s", spec.instance, exc)
        if spec.previous_version:
            old = instance_key(spec.name, spec.previous_version)
            if any(instance_state(w, old) is not None for w in await self._registry.workers(fresh=True)):
                return  # still draining somewhere

            def clear(current: ModelSpec) -> ModelSpec | None:
                if current.previous_version != spec.previous_version:
                    return None
                return dataclasses.replace(current, previous_version=0)

            try:
                if await self._models.update(spec.name, clear) is not None:
                    log.info("%s: version %d drained everywhere", spec.name, spec.previous_version)
            except SpecConflict:
                pass  # changed meanwhile; the next pass looks again

    async def run(self) -> None:
        while True:
            try:
                await self.run_once()
            except (redis.RedisError, OSError) as exc:
                if not self._health.absorb(exc):  # an outage is logged once, by the Redis watch
                    log.warning("reconcile pass skipped: %s", exc)
            except Exception:
                log.exception("reconcile pass failed")
            await asyncio.sleep(self._interval_s)


RECONCILER = web.AppKey("reconciler", Reconciler)
PREWARMER = web.AppKey("prewarmer", Prewarmer)


async def reconciler_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    reconciler = app[RECONCILER] = Reconciler(app[REDIS], app[MODEL_REGISTRY], app[PLACEMENT], app[WORKER_REGISTRY],
                                              config.reconcile_interval_s, config.model_load_timeout,
                                              app[REDIS_WATCH].health)
    prewarmer = app[PREWARMER] = Prewarmer(app[REDIS], app[MODEL_REGISTRY], app[PLACEMENT], app[WORKER_REGISTRY],
                                           config.model_load_timeout)
    tasks = []
    if config.reconcile_interval_s > 0:
        loop = asyncio.get_running_loop()
        tasks.append(loop.create_task(reconciler.run(), name="kvrelay-reconciler"))
        tasks.append(loop.create_task(prewarmer.run(min(PREWARM_EVERY_S, config.reconcile_interval_s),
                                                    app[REDIS_WATCH].health), name="kvrelay-prewarm"))
    yield
    for task in tasks:
        await cancel_and_wait(task)
    await prewarmer.close()
