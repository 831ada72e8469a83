"""The gateway's judgement of a worker whose engine loop stopped stepping (gateway/control/stalled_workers.py):
past --stalled-step-timeout-s it is live but not routable, logged once when the stall begins and once when it
steps again; the registry, over real Redis, routes and counts capacity by the routable workers only."""

import logging
import time

import pytest

from kvrelay.gateway.control.stalled_workers import Stalls
from kvrelay.gateway.control.worker_registry import WorkerRegistry
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import async_client
from tests.integration.model_pool_harness import own_db

TIMEOUT_S = 60.0


def _worker(worker_id: str, step_age_s: float = 0.0, role: str = "unified", model: str = "m") -> WorkerInfo:
    now = time.time()
    return WorkerInfo(worker_id=worker_id, role=role, models=[model], zmq_addr="tcp://127.0.0.1:1", free_blocks=8,
                      total_blocks=8, running=1, waiting=0, pid=1, host="h", started=now, heartbeat=now,
                      step_age_s=step_age_s)


def test_a_worker_in_one_step_past_the_timeout_is_not_routable():
    stalls = Stalls(TIMEOUT_S)
    workers = [_worker("fine", 0.0), _worker("slow", TIMEOUT_S - 1), _worker("stuck", TIMEOUT_S + 1)]
    stalls.update(workers)
    assert [w.worker_id for w in stalls.routable(workers)] == ["fine", "slow"]
    assert stalls.ages == {"stuck": TIMEOUT_S + 1}
    why = stalls.describe(workers)
    assert why.startswith("stuck (") and "61 s" in why and "--stalled-step-timeout-s 60" in why


def test_a_zero_timeout_never_judges_a_worker_stalled():
    stalls = Stalls(0.0)
    workers = [_worker("stuck", 10_000.0)]
    stalls.update(workers)
    assert stalls.routable(workers) == workers and stalls.ages == {}


def test_a_stall_is_logged_once_when_it_begins_and_once_when_it_ends(caplog):
    stalls = Stalls(TIMEOUT_S)
    with caplog.at_level(logging.INFO, logger="kvrelay.gateway"):
        for age in (TIMEOUT_S + 1, TIMEOUT_S + 5, TIMEOUT_S + 9):  # one stall, read three times
            stalls.update([_worker("stuck", age)])
        stalls.update([_worker("stuck", 0.0)])
        stalls.update([_worker("stuck", 0.0)])
        stalls.update([_worker("stuck", TIMEOUT_S + 2)])  # a second stall
        stalls.update([])  # gone (its stall watch ended it): nothing to say of a worker that left
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO", "WARNING"], lines
    assert "'stuck' is stalled" in lines[0][1] and "steps again" in lines[1][1]


@pytest.fixture()
async def registry_redis(redis_url):
    client = async_client(own_db(redis_url, 15))
    yield client
    ids = ["w-fine", "w-stuck"]
    await client.delete(*(keys.worker_key(w) for w in ids))
    await client.srem(keys.WORKERS_INDEX, *ids)
    await client.aclose()


async def test_the_registry_routes_and_counts_capacity_by_the_workers_that_step(registry_redis):
    for info in (_worker("w-fine"), _worker("w-stuck", TIMEOUT_S + 30)):
        await registry_redis.set(keys.worker_key(info.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
        await registry_redis.sadd(keys.WORKERS_INDEX, info.worker_id)
    registry = WorkerRegistry(registry_redis, cache_s=0.0, stalled_step_timeout_s=TIMEOUT_S)
    assert [w.worker_id for w in await registry.workers()] == ["w-fine", "w-stuck"]  # live, both
    assert [w.worker_id for w in await registry.routable()] == ["w-fine"]
    capacity = await registry.capacity("m")
    assert (capacity.prefill, capacity.decode) == (1, 1)
    await registry_redis.set(keys.worker_key("w-fine"), encode(_worker("w-fine", TIMEOUT_S + 1)))
    assert not (await registry.capacity("m")).servable


async def test_a_model_is_stalled_out_when_every_live_worker_of_one_phase_is_stalled(registry_redis):
    """What routing's and /ready's 503 say: only where the stall, not a missing phase, keeps the model from jobs."""
    registry = WorkerRegistry(registry_redis, cache_s=0.0, stalled_step_timeout_s=TIMEOUT_S)
    stuck, decode = _worker("p-stuck", TIMEOUT_S + 1, role="prefill"), _worker("d", role="decode")
    registry.stalls.update([stuck, decode])
    why = registry.stalled_out([stuck, decode], "m")
    assert why is not None and why.startswith("every prefill worker of model 'm' is stalled: p-stuck (")
    assert registry.stalled_out([stuck], "m") is None  # no live decode worker: the stall is not what is missing
    assert registry.stalled_out([stuck, decode], "other") is None
    registry.stalls.update([fine := _worker("p"), stuck, decode])
    assert registry.stalled_out([fine, stuck, decode], "m") is None  # a prefill worker that steps takes its jobs
