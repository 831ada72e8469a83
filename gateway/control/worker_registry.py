"""The gateway's read-only view of what workers published in Redis: models and live workers.

Views are cached for ``registry_cache_s`` so a burst of requests costs one Redis round trip, not one
each; registration changes show up within that delay. Live workers whose engine loop stopped stepping are
live all the same, but not ``routable`` (stalled_workers.py). Whoever waits for a change it caused (a model
load) reads with ``fresh=True``. Model names here are instance keys ("name@3"); the client-facing
names live in ``model_registry.py``.

The requests that find a view stale share one read of it, sent after they asked (``coalesced.py``): reads of
one kind never overlap, so none finishes after a newer one. A read in flight when the view is invalidated
answers its callers but is not cached: it may predate what the invalidating caller knows changed.
"""

import logging
import time
from dataclasses import dataclass

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.coalesced import Coalesced
from kvrelay.gateway.control.stalled_workers import Stalls
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import ModelInfo, WorkerInfo
from kvrelay.shared.wire.version import PROTOCOL_VERSION, version_refusal

log = logging.getLogger("kvrelay.gateway")


@dataclass
class Capacity:
    """How many live workers can take each half of a request for one model."""

    prefill: int
    decode: int

    @property
    def servable(self) -> bool:
        return self.prefill > 0 and self.decode > 0


def capacity_of(workers: list[WorkerInfo], model: str) -> Capacity:
    """The live workers among ``workers`` that can take each half of a request for instance ``model``."""
    serving = [w for w in workers if model in w.models]
    return Capacity(prefill=sum(w.can_prefill for w in serving), decode=sum(w.can_decode for w in serving))


def stalled_out(live: Capacity, routable: Capacity) -> bool:
    """Live workers hold both phases of a model, but for one phase only stalled ones: its requests get 503
    until they step again (``require_capacity``), and a load would find it loaded."""
    return live.servable and not routable.servable


async def read_indexed(client: redis.asyncio.Redis, index: str, key_of, cls) -> dict:
    """Every record named in the set ``index`` (one SMEMBERS, one MGET), decoded as ``cls``; missing
    records are skipped, malformed ones logged and skipped."""
    names = sorted(n.decode() for n in await client.smembers(index))
    raw = await client.mget([key_of(n) for n in names]) if names else []
    out = {}
    for name, data in zip(names, raw, strict=True):
        if data is None:
            continue
        try:
            out[name] = decode(data, cls)
        except ValueError as exc:
            log.warning("ignoring malformed %s for %r: %s", cls.__name__, name, exc)
    return out


class WorkerRegistry:
    def __init__(self, client: redis.asyncio.Redis, cache_s: float, stalled_step_timeout_s: float = 0.0):
        self._redis = client
        self._cache_s = cache_s
        self.stalls = Stalls(stalled_step_timeout_s)
        self._models: tuple[float, dict[str, ModelInfo]] | None = None
        self._workers: tuple[float, list[WorkerInfo]] | None = None
        self._invalidations = 0  # a read caches its view only if none came while it was in flight
        self.refused: dict[str, str] = {}  # worker id -> why its heartbeat is not taken, as of the last read
        self._noted: dict[str, str] = {}  # worker id -> what was last logged of it: once per worker, not per read
        # a burst that finds the cache stale shares its reads instead of sending one each
        self._models_read = Coalesced(self._read_models)
        self._workers_read = Coalesced(self._read_workers)

    def _fresh(self, entry: tuple[float, object] | None) -> bool:
        return entry is not None and time.monotonic() - entry[0] < self._cache_s

    def invalidate(self) -> None:
        self._models = self._workers = None
        self._invalidations += 1

    async def models(self, fresh: bool = False) -> dict[str, ModelInfo]:
        if not fresh and self._fresh(self._models):
            return self._models[1]
        return await self._models_read()

    async def _read_models(self) -> dict[str, ModelInfo]:
        invalidations, started = self._invalidations, time.monotonic()
        # indexed but unpublished (or deleted): not servable
        models = await read_indexed(self._redis, keys.MODELS_INDEX, keys.model_key, ModelInfo)
        if invalidations == self._invalidations:
            self._models = (started, models)
        return models

    async def model(self, name: str, fresh: bool = False) -> ModelInfo | None:
        return (await self.models(fresh)).get(name)

    async def workers(self, fresh: bool = False) -> list[WorkerInfo]:
        """Workers whose heartbeat record has not expired (nor gone stale, should its TTL be missing)."""
        if not fresh and self._fresh(self._workers):
            return self._workers[1]
        return await self._workers_read()

    async def _read_workers(self) -> list[WorkerInfo]:
        invalidations, started = self._invalidations, time.monotonic()
        ids = sorted(w.decode() for w in await self._redis.smembers(keys.WORKERS_INDEX))
        raw = await self._redis.mget([keys.worker_key(w) for w in ids]) if ids else []
        now = time.time()
        workers, refused, noted = [], {}, {}
        for worker_id, data in zip(ids, raw, strict=True):
            if data is None:
                continue
            try:
                info = decode(data, WorkerInfo)
            except ValueError as exc:  # a newer worker's must-understand field says so here
                refused[worker_id] = noted[worker_id] = f"ignoring malformed WorkerInfo for {worker_id!r}: {exc}"
                continue
            if now - info.heartbeat > keys.HEARTBEAT_TTL_S:
                continue
            if why := version_refusal(info.protocol, f"worker {worker_id!r}"):
                refused[worker_id] = noted[worker_id] = why
                continue
            if info.protocol != PROTOCOL_VERSION:
                noted[worker_id] = (f"worker {worker_id!r} speaks wire protocol {info.protocol}, this gateway "
                                    f"{PROTOCOL_VERSION}: one version apart, served")
            workers.append(info)
        if invalidations != self._invalidations:
            return workers  # the next read (the invalidation emptied the cache) judges what it finds
        for worker_id, line in noted.items():
            if self._noted.get(worker_id) != line:
                (log.warning if worker_id in refused else log.info)("%s", line)
        self.refused, self._noted = refused, noted
        self.stalls.update(workers)
        self._workers = (started, workers)
        return workers

    async def routable(self, fresh: bool = False) -> list[WorkerInfo]:
        """Live workers new jobs may go to: those whose engine loop steps."""
        return self.stalls.routable(await self.workers(fresh))

    async def capacity(self, model: str, fresh: bool = False) -> Capacity:
        """The routable workers' capacity for ``model``."""
        return capacity_of(await self.routable(fresh), model)

    def stalled_out(self, live: list[WorkerInfo], model: str) -> str | None:
        """Why instance ``model`` takes no new job though ``live`` (the last read of the workers) holds both its
        phases: every live worker of one phase is stalled. None when it takes jobs, or lacks a live phase."""
        routable = capacity_of(self.stalls.routable(live), model)
        if not stalled_out(capacity_of(live, model), routable):
            return None
        missing = "prefill" if routable.prefill == 0 else "decode"
        stalled = self.stalls.describe([w for w in live if model in w.models])
        return f"every {missing} worker of model {model!r} is stalled: {stalled}"


WORKER_REGISTRY = web.AppKey("worker_registry", WorkerRegistry)
