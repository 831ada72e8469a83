"""Prewarm's deadline math (gateway/control/prewarm.py) against real Redis and the real gateway app: a
model no worker holds is loaded when its queue holds jobs that can still be served, the least slack
first; not when every queued job would miss its deadline anyway, and never for an empty queue. The
workers are the scripted layer of model_pool_harness.py; tests/e2e/test_pool_demand.py runs real ones."""

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from kvrelay.gateway.control.reconciler import PREWARMER
from kvrelay.gateway.state import DISPATCHER
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.integration.model_pool_harness import Env, add_version, model_pool, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    tmp_path = tmp_path_factory.mktemp("prewarm")
    for name in ("early", "late", "stale", "quiet"):
        add_version(tmp_path / "repo", name, 1)
    with model_pool(redis_url, tmp_path / "repo", tmp_path, db=11) as env:
        for name in ("early", "late", "stale", "quiet"):
            assert env.admin("POST", "/admin/models", json={"name": name}).status_code == 201
        yield env


@pytest.fixture
def worker(env) -> Iterator:
    started = []

    def start(worker_id: str):
        started.append(env.worker(worker_id))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def queue(env: Env, instance: str, deadline_in_s: float) -> None:
    """A job as a gateway queues it (its events go to our gateway, which no request there waits for)."""
    now = time.time()
    job = Job(request_id=uuid.uuid4().hex, model=instance, prompt_token_ids=[1, 2, 3],
              sampling=SamplingParams(max_tokens=4), tenant="t1", priority=0, reply_addr=env.server.app[DISPATCHER].address,
              deadline=now + deadline_in_s, arrival=now)
    sync_client(env.redis_url).xadd(keys.prefill_stream(instance), {keys.JOB_FIELD: encode(job)})


def prewarm(env: Env, demand_only: bool = False):
    prewarmer = env.server.app[PREWARMER]
    coro = prewarmer.demand() if demand_only else prewarmer.run_once()
    return asyncio.run_coroutine_threadsafe(coro, env.server.loop).result(60)


def test_queued_jobs_load_a_model_no_worker_holds_least_slack_first(env, worker):
    w = worker("prewarm-1")
    queue(env, "late@1", 600)
    queue(env, "early@1", 60)
    queue(env, "early@1", 90)
    demand = prewarm(env, demand_only=True)
    assert [(d.spec.instance, d.depth) for d in demand] == [("early@1", 2), ("late@1", 1)]
    assert prewarm(env) == ["early@1", "late@1"]
    until(lambda: {c.instance for c in w.ops("load")} == {"early@1", "late@1"}, "both prewarmed")
    until(lambda: not prewarm(env, demand_only=True), "held now: no more demand")  # loaded (or loading)
    assert "quiet@1" not in {c.instance for c in w.ops("load")}  # nothing queued: never prewarmed
    until(lambda: {i for i, s in w.states.items() if s.state == "ready"} == {"early@1", "late@1"}, "both loaded")
    # the scripted workers ACK without deleting (real ones delete): no stale queue for the next test, once
    # nothing reads it any more
    w.stop()
    sync_client(env.redis_url).delete(keys.prefill_stream("early@1"), keys.prefill_stream("late@1"))


def test_jobs_that_would_all_miss_anyway_load_nothing(env, worker):
    w = worker("prewarm-2")
    queue(env, "stale@1", -1)  # its deadline passed: the workers will drop it unread
    (d,) = [d for d in prewarm(env, demand_only=True) if d.spec.instance == "stale@1"]
    assert d.depth == 1 and d.slack < 0 and d.hopeless
    assert "stale@1" not in prewarm(env)
    time.sleep(0.5)
    assert "stale@1" not in {c.instance for c in w.ops("load")}
    queue(env, "stale@1", 60)  # a newer job that can still be served: loaded for it
    (d,) = [d for d in prewarm(env, demand_only=True) if d.spec.instance == "stale@1"]
    assert d.depth == 2 and d.slack < 0 and not d.hopeless
    assert "stale@1" in prewarm(env)
    until(lambda: "stale@1" in w.serving, "loaded for the job that can make it")
    w.stop()  # then no stale queue for the next test (see above)
    sync_client(env.redis_url).delete(keys.prefill_stream("stale@1"))


def test_a_load_no_worker_has_room_for_is_not_asked_for_every_pass(env):
    w = env.worker("prewarm-3", refuse="not enough memory to load quiet@1")
    try:
        queue(env, "quiet@1", 60)
        assert "quiet@1" in prewarm(env)
        until(lambda: not env.server.app[PREWARMER].loads, "the refused load ended")
        assert [c.instance for c in w.ops("load")] == ["quiet@1"]
        assert "quiet@1" not in prewarm(env)  # within RETRY_AFTER_FAILURE_S: not again yet
        assert [c.instance for c in w.ops("load")] == ["quiet@1"]
    finally:
        w.stop()
        sync_client(env.redis_url).delete(keys.prefill_stream("quiet@1"))
