"""Reads of the gateway's registry asked for while one is in flight: they share the next read, sent after they
asked, so they see what changed meanwhile and an older read never replaces a newer one in the cache; a read
in flight when the view is invalidated is not cached. A real Redis answers every read; only when the first
one returns is held."""

import asyncio
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
        self.calls = 0
        self.answered, self.release = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def mget(self, names):
        self.calls += 1
        first = self.calls == 1
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


async def test_a_read_asked_for_while_one_is_in_flight_gets_the_next_and_the_older_never_replaces_it(client):
    await _publish(client, _worker("order-old", TIMEOUT_S + 1))  # stalled as the first read sees it
    held = FirstReadHeld(client)
    registry = WorkerRegistry(held, cache_s=3600.0, stalled_step_timeout_s=TIMEOUT_S)
    first = asyncio.create_task(registry.workers(fresh=True))
    await held.answered.wait()
    # while the first read's answer is on its way: the worker steps again and another registers
    await _publish(client, _worker("order-old"))
    await _publish(client, _worker("order-new"))
    second = asyncio.create_task(registry.workers(fresh=True))
    await asyncio.sleep(0.05)
    assert not second.done()  # it waits for a read sent after it asked, not for the one on its way
    held.release.set()
    older, newer = await first, await second
    assert [w.worker_id for w in older if w.worker_id in WORKERS] == ["order-old"]  # its caller's own read
    assert [w.worker_id for w in newer if w.worker_id in WORKERS] == ["order-new", "order-old"]
    assert held.calls == 2
    cached = await registry.workers()
    assert [w.worker_id for w in cached if w.worker_id in WORKERS] == ["order-new", "order-old"]
    # judged last, the newer read's steps stand: the worker stalled in the older read is routable again
    assert [w.worker_id for w in await registry.routable() if w.worker_id in WORKERS] == ["order-new", "order-old"]


async def test_a_burst_past_the_cache_shares_its_reads(client):
    await _publish(client, _worker("order-old"))
    held = FirstReadHeld(client)
    registry = WorkerRegistry(held, cache_s=3600.0)
    first = asyncio.create_task(registry.workers())
    await held.answered.wait()
    await _publish(client, _worker("order-new"))
    burst = [asyncio.create_task(registry.workers()) for _ in range(20)]
    await asyncio.sleep(0.05)
    held.release.set()
    await first
    views = await asyncio.gather(*burst)
    assert held.calls == 2  # one read for the first caller, one for the 20 that came while it was in flight
    assert all([w.worker_id for w in view if w.worker_id in WORKERS] == ["order-new", "order-old"] for view in views)


async def test_a_read_of_the_models_asked_for_while_one_is_in_flight_sees_what_changed(client):
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
    second = asyncio.create_task(registry.models(fresh=True))
    await asyncio.sleep(0.05)
    held.release.set()
    assert "order-m@2" not in await first
    assert {"order-m@1", "order-m@2"} <= (await second).keys()
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
