"""Two reads of the gateway's registry that overlap in its one event loop and finish out of order: the one that
started first, finishing last, never replaces the newer one in the cache, nor is it judged for stalls after it;
its caller still gets its own read. A real Redis answers every read; only when the first one returns is held."""

import asyncio
import logging
import time

import pytest

from kvrelay.gateway.control.worker_registry import WorkerRegistry
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ModelInfo, WorkerInfo
from kvrelay.shared.wire.redis_conn import async_client
from tests.integration.model_pool_harness import own_db

TIMEOUT_S = 60.0
WORKERS = ("order-old", "order-new")
MODELS = ("order-m@1", "order-m@2")


class FirstReadHeld:
    """The registry's Redis client, except that the first MGET's answer (Redis's own) is returned only once
    ``release`` is set; ``answered`` says Redis has answered it."""

    def __init__(self, client):
        self._client = client
        self._calls = 0
        self.answered, self.release = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def mget(self, names):
        self._calls += 1
        first = self._calls == 1
        raw = await self._client.mget(names)
        if first:
            self.answered.set()
            await self.release.wait()
        return raw


@pytest.fixture()
async def client(redis_url):
    client = async_client(own_db(redis_url, 15))
    yield client
    await client.delete(*(keys.worker_key(w) for w in WORKERS), *(keys.model_key(m) for m in MODELS))
    await client.srem(keys.WORKERS_INDEX, *WORKERS)
    await client.srem(keys.MODELS_INDEX, *MODELS)
    await client.aclose()


def _worker(worker_id: str, step_age_s: float = 0.0) -> WorkerInfo:
    now = time.time()
    return WorkerInfo(worker_id=worker_id, role="unified", models=["order-m@1"], zmq_addr="tcp://127.0.0.1:1",
                      free_blocks=8, total_blocks=8, running=1, waiting=0, pid=1, host="h", started=now,
                      heartbeat=now, step_age_s=step_age_s)


async def _publish(client, info: WorkerInfo) -> None:
    await client.set(keys.worker_key(info.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
    await client.sadd(keys.WORKERS_INDEX, info.worker_id)


async def test_an_older_read_of_the_workers_finishing_last_neither_replaces_the_newer_nor_is_judged_after_it(
        client, caplog):
    await _publish(client, _worker("order-old", TIMEOUT_S + 1))  # stalled as the first read sees it
    held = FirstReadHeld(client)
    registry = WorkerRegistry(held, cache_s=3600.0, stalled_step_timeout_s=TIMEOUT_S)
    with caplog.at_level(logging.INFO, logger="kvrelay.gateway"):
        first = asyncio.create_task(registry.workers(fresh=True))
        await held.answered.wait()
        # while the first read's answer is on its way: the worker steps again and another registers
        await _publish(client, _worker("order-old"))
        await _publish(client, _worker("order-new"))
        newer = await registry.workers(fresh=True)
        held.release.set()
        older = await first
    assert [w.worker_id for w in newer if w.worker_id in WORKERS] == ["order-new", "order-old"]
    assert [w.worker_id for w in older if w.worker_id in WORKERS] == ["order-old"]  # its caller's own read
    cached = await registry.workers()
    assert [w.worker_id for w in cached if w.worker_id in WORKERS] == ["order-new", "order-old"]
    assert [w.worker_id for w in await registry.routable() if w.worker_id in WORKERS] == ["order-new", "order-old"]
    assert not any("stalled" in r.getMessage() or "steps again" in r.getMessage() for r in caplog.records)


async def test_an_older_read_of_the_models_finishing_last_does_not_replace_the_newer(client):
    def model(name: str) -> ModelInfo:
        return ModelInfo(name=name, path="/m", max_model_len=64, vocab_size=32, eos_token_ids=[0], block_size=8,
                         dtype="float32")

    await client.set(keys.model_key("order-m@1"), encode(model("order-m@1")))
    await client.sadd(keys.MODELS_INDEX, "order-m@1")
    held = FirstReadHeld(client)
    registry = WorkerRegistry(held, cache_s=3600.0)
    first = asyncio.create_task(registry.models(fresh=True))
    await held.answered.wait()
    await client.set(keys.model_key("order-m@2"), encode(model("order-m@2")))
    await client.sadd(keys.MODELS_INDEX, "order-m@2")
    assert {"order-m@1", "order-m@2"} <= (await registry.models(fresh=True)).keys()
    held.release.set()
    assert "order-m@2" not in await first
    assert {"order-m@1", "order-m@2"} <= (await registry.models()).keys()


async def test_a_read_started_before_an_invalidation_is_not_cached(client):
    await _publish(client, _worker("order-old"))
    held = FirstReadHeld(client)
    registry = WorkerRegistry(held, cache_s=3600.0)
    first = asyncio.create_task(registry.workers(fresh=True))
    await held.answered.wait()
    await _publish(client, _worker("order-new"))
    registry.invalidate()  # what a caller does once it knows Redis changed
    held.release.set()
    await first
    assert "order-new" in [w.worker_id for w in await registry.workers()]
