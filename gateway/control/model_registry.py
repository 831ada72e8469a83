"""The registered models (``ModelSpec``, the desired state in Redis) and how a client's model name
becomes the instance that serves it.

Two kinds of model answer to a client's name:
  * registered (admin API, ``kvrelay serve --config``): ``spec.version`` picks the instance
    ("name@3"); during a swap the spec flips only once the new version is ready, so new requests go
    to it while the old instance drains what it already holds;
  * published directly by a worker started with ``--model`` (version 0, never registered): the
    instance is the name itself, exactly as before the registry existed.
A registered name wins over a direct one of the same name. Clients only ever see the name.

The registry lives in Redis only. A gateway keeps its last view of it, with the ``run_id`` of the
server it read it from (asked first: a restart between the two reads labels a new server's view as the
old one's, never the reverse), and when Redis answers as another server, at its next read or when the
Redis watch sees it back (``republish``), puts back every entry of that view the new one lacks (SET NX:
a Redis restored from its file keeps what it has). Entries this gateway deletes leave its view at
once; one deleted through another gateway inside its last refresh (0.5 s) may come back.
"""

import logging
import time
from collections.abc import Callable

import redis
import redis.asyncio
from aiohttp import web

from kvrelay.gateway.coalesced import Coalesced
from kvrelay.gateway.control.worker_registry import read_indexed
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec

log = logging.getLogger("kvrelay.gateway")


def is_direct(info: ModelInfo) -> bool:
    """A model a worker was given by path (not a repository version): addressable by its own name."""
    return info.version == 0 and "@" not in info.name


def served_name(info: ModelInfo) -> str:
    return info.served_name or info.name


class SpecConflict(Exception):
    """The spec changed under a read-modify-write; the caller retries or gives up."""


class ModelRegistry:
    def __init__(self, client: redis.asyncio.Redis, cache_s: float):
        self._redis = client
        self._cache_s = cache_s
        self._specs: tuple[float, dict[str, ModelSpec]] | None = None
        self._known: tuple[str | None, dict[str, ModelSpec]] = (None, {})  # run_id of the server read, view
        self._specs_read = Coalesced(self._read_specs)  # a burst past the cache shares its reads
        self._invalidations = 0

    def invalidate(self) -> None:
        self._specs = None
        self._invalidations += 1  # a read in flight now answers its callers but is not cached

    async def specs(self, fresh: bool = False) -> dict[str, ModelSpec]:
        # Cached like the worker view: one request burst costs one round trip. Swaps wait out this
        # cache before draining the old version (placement.py), so a stale read still finds it serving.
        if not fresh and self._specs is not None and time.monotonic() - self._specs[0] < self._cache_s:
            return self._specs[1]
        return await self._specs_read()

    async def _read_specs(self) -> dict[str, ModelSpec]:
        invalidations = self._invalidations
        run_id = _run_id(await self._redis.info("server"))
        await self.republish(run_id)
        specs = await read_indexed(self._redis, keys.REGISTRY_INDEX, keys.registry_key, ModelSpec)
        if invalidations == self._invalidations:
            self._specs = (time.monotonic(), specs)
        self._known = (run_id, dict(specs))
        return specs

    async def republish(self, run_id: str | None) -> int:
        """Redis answers as server ``run_id``: the entries of our last view (read from another server) that
        it lacks go back. Returns how many."""
        read_from, specs = self._known
        if read_from is None or read_from == run_id or not specs:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for spec in specs.values():
            pipe.set(keys.registry_key(spec.name), encode(spec), nx=True)
            pipe.sadd(keys.REGISTRY_INDEX, spec.name)
        restored = sum(bool(r) for r in (await pipe.execute())[::2])
        self._known = (run_id, specs)
        self.invalidate()
        if restored:
            log.info("registered %d model(s) again in a Redis that lost them", restored)
        return restored

    async def spec(self, name: str) -> ModelSpec | None:
        """Always from Redis: admin operations act on the current state, not a cached one."""
        data = await self._redis.get(keys.registry_key(name))
        return None if data is None else decode(data, ModelSpec)

    async def put(self, spec: ModelSpec) -> None:
        spec.updated = time.time()
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(keys.registry_key(spec.name), encode(spec))
        pipe.sadd(keys.REGISTRY_INDEX, spec.name)
        await pipe.execute()
        self.invalidate()
        self._known[1][spec.name] = spec

    async def update(self, name: str, change: Callable[[ModelSpec], ModelSpec | None]) -> ModelSpec | None:
        """Apply ``change`` to the stored spec atomically (WATCH/MULTI); ``change`` returning None
        leaves it as it is. Returns the spec written, or None when absent or unchanged. Raises
        SpecConflict when another writer got in between."""
        key = keys.registry_key(name)
        async with self._redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                data = await pipe.get(key)
                if data is None:
                    return None
                new = change(decode(data, ModelSpec))
                if new is None:
                    return None
                new.updated = time.time()
                pipe.multi()
                pipe.set(key, encode(new))
                await pipe.execute()
            except redis.WatchError:
                raise SpecConflict(f"model {name!r} changed concurrently; retry") from None
        self.invalidate()
        self._known[1][name] = new
        return new

    async def delete(self, name: str) -> bool:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(keys.registry_key(name))
        pipe.srem(keys.REGISTRY_INDEX, name)
        deleted, _ = await pipe.execute()
        self.invalidate()
        self._known[1].pop(name, None)
        return bool(deleted)

    async def served_names(self, models: dict[str, ModelInfo]) -> list[str]:
        """What clients may ask for: registered names plus directly published models."""
        names = set(await self.specs()) | {m.name for m in models.values() if is_direct(m)}
        return sorted(names)


def _run_id(info: dict) -> str | None:
    run_id = info.get("run_id")
    return run_id.decode() if isinstance(run_id, bytes) else run_id


MODEL_REGISTRY = web.AppKey("model_registry", ModelRegistry)
