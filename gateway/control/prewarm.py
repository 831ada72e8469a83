"""Prewarm: a registered model whose queue holds jobs while no worker holds it is loaded before those jobs
run out of time, without waiting for a request to ask for it.

Requests for a model no worker holds normally load it themselves (``served.py``: the first request's lazy
load; ``reload_wait.py``: a queued request whose model left). Prewarm is the pool's view of the same
demand: it acts on what is queued, whoever queued it (any gateway, one of an older release, a client
that queues jobs directly as tests/e2e/jobs.py does), and decides across models which load first.
Eviction weighs demand against reload cost (shared/worker/eviction.py; a prewarm load's demand is its
queue depth, ``ControlCommand.waiting``); this is the other half of that trade, the one that brings a model
back by demand.

Every ``PREWARM_EVERY_S`` (or ``--reconcile-interval-s`` if shorter; 0 turns both off) each gateway
reads, for each registered instance no live worker holds, the length of its queues (the shared stream
and the live workers' private ones) and its oldest and newest jobs' deadlines. The deadline math: a job
can still be served if its model's load, at the cost it took last time (``InstanceStatus.load_s``,
remembered while a worker advertised it), ends before the job's deadline, after which the workers drop
it. Instances with such jobs are loaded now, the least slack (of the oldest job) first
(``Placement.ensure_loaded``: one load per instance across gateways); an instance whose newest queued
job would miss even so is not loaded (it would only evict models that are in use), and one with an
empty queue (idle) never is.
"""

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import redis
import redis.asyncio

from kvrelay.gateway.control.model_registry import ModelRegistry
from kvrelay.gateway.control.placement import LoadError, Placement, instance_state
from kvrelay.gateway.control.worker_registry import WorkerRegistry
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.priority_bands import shared_streams
from kvrelay.shared.wire.protocol import Job, ModelSpec, WorkerInfo
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger("kvrelay.gateway")

PREWARM_EVERY_S = 1.0  # a pass is one pipelined read per cold instance; jobs wait seconds, not minutes
RETRY_AFTER_FAILURE_S = 5.0  # a load no worker had room for is not asked for again every pass
_HELD = ("loading", "ready", "draining")  # a worker in one of these states reads (or will read) the queue


@dataclass
class Demand:
    spec: ModelSpec
    depth: int  # jobs queued
    due: float  # unix seconds: the oldest queued job's deadline (0: none)
    last_due: float  # the newest queued job's
    reload_s: float  # what its load is expected to take

    @property
    def slack(self) -> float:
        """Seconds to spare if the load starts now; negative: the oldest job misses even so."""
        return float("inf") if not self.due else self.due - time.time() - self.reload_s

    @property
    def hopeless(self) -> bool:
        """Even the newest queued job would miss its deadline if the load started now."""
        return bool(self.last_due) and self.last_due - time.time() - self.reload_s < 0


class Prewarmer:
    def __init__(self, client: redis.asyncio.Redis, models: ModelRegistry, placement: Placement,
                 registry: WorkerRegistry, load_timeout: float):
        self._redis = client
        self._models = models
        self._placement = placement
        self._registry = registry
        self._load_timeout = load_timeout
        self._reload_s: dict[str, float] = {}  # instance -> its last load's seconds, as a worker advertised it
        self.loads: dict[str, asyncio.Task] = {}  # instance -> the prewarm load in progress
        self.started: list[str] = []  # every instance a pass started loading (logs, tests)
        self._failed_at: dict[str, float] = {}  # instance -> monotonic time its prewarm load failed

    async def demand(self) -> list[Demand]:
        """The registered instances no live worker holds that have jobs queued, the least slack first."""
        workers = await self._registry.workers(fresh=True)
        self._remember_load_costs(workers)
        now = time.monotonic()
        cold = [s for s in (await self._models.specs()).values()
                if s.instance not in self.loads and now - self._failed_at.get(s.instance, -math.inf) > RETRY_AFTER_FAILURE_S
                and not any(instance_state(w, s.instance) in _HELD for w in workers)]
        if not cold:
            return []
        pipe = self._redis.pipeline(transaction=False)
        streams = {s.instance: [*shared_streams(s.instance),
                                *(keys.prefill_worker_stream(s.instance, w.worker_id) for w in workers)]
                   for s in cold}
        for spec in cold:
            for stream in streams[spec.instance]:
                pipe.xlen(stream)
                pipe.xrange(stream, count=1)  # the oldest entry
                pipe.xrevrange(stream, count=1)  # the newest
        replies = await pipe.execute()
        out, i = [], 0
        for spec in cold:
            depth, firsts, lasts = 0, [], []
            for _ in streams[spec.instance]:
                length, first, last = replies[i:i + 3]
                i += 3
                depth += length
                firsts += [d for d in (_deadline(e[1]) for e in first) if d]
                lasts += [d for d in (_deadline(e[1]) for e in last) if d]
            if depth:
                out.append(Demand(spec, depth, min(firsts, default=0.0), max(lasts, default=0.0),
                                  self._reload_s.get(spec.instance, 0.0)))
        return sorted(out, key=lambda d: d.slack)

    async def run_once(self) -> list[str]:
        """One pass: start the loads the queues call for. The instances it started."""
        started = []
        for d in await self.demand():
            if d.hopeless:
                log.debug("not prewarming %s: its %d queued job(s) would miss their deadline even so (reload "
                         "%.1fs)", d.spec.instance, d.depth, d.reload_s)
                continue
            log.info("prewarming %s: %d job(s) queued while no worker holds it (slack %.1fs)",
                     d.spec.instance, d.depth, d.slack)
            task = asyncio.get_running_loop().create_task(self._load(d.spec))
            self.loads[d.spec.instance] = task
            task.add_done_callback(lambda t, inst=d.spec.instance: self.loads.pop(inst, None))
            started.append(d.spec.instance)
        self.started += started
        return started

    async def _load(self, spec: ModelSpec) -> None:
        try:
            await self._placement.ensure_loaded(spec, self._load_timeout)
        except LoadError as exc:
            self._failed_at[spec.instance] = time.monotonic()
            log.warning("prewarming %s failed (tried again in %.0fs at the earliest): %s", spec.instance,
                        RETRY_AFTER_FAILURE_S, exc)

    async def run(self, interval_s: float, health: RedisHealth) -> None:
        while True:
            try:
                await self.run_once()
            except (redis.RedisError, OSError) as exc:
                if not health.absorb(exc):  # an outage is logged once, by the Redis watch
                    log.warning("prewarm pass skipped: %s", exc)
            except Exception:
                log.exception("prewarm pass failed")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        tasks = list(self.loads.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _remember_load_costs(self, workers: list[WorkerInfo]) -> None:
        seen: dict[str, float] = {}
        for w in workers:
            for status in w.instances:
                if status.state == "ready" and status.load_s > 0:  # the slower role bounds when both are up
                    seen[status.instance] = max(status.load_s, seen.get(status.instance, 0.0))
        self._reload_s.update(seen)


def _deadline(fields: dict) -> float:
    try:
        return decode(fields[keys.JOB_FIELD.encode()], Job).deadline
    except (KeyError, ValueError):
        return 0.0  # a malformed job goes to the dead-letter stream; it sets no deadline here
