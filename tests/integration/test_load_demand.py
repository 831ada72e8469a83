"""The demand a load command carries (gateway/control/placement.py, ``ControlCommand.waiting``), against real
Redis and the real gateway app: requests waiting on a lazy load and jobs queued for the instance are counted,
an operator's load is no request. The worker decides evictions from it (shared/worker/eviction.py); the
workers are the scripted layer of model_pool_harness.py."""

import concurrent.futures
from collections.abc import Iterator

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.model_pool_harness import Env, add_version, model_pool, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def env(redis_url, tmp_path) -> Iterator[Env]:
    for name in ("alpha", "beta"):
        add_version(tmp_path / "repo", name, 1)
    with model_pool(redis_url, tmp_path / "repo", tmp_path, db=13) as env:
        for name in ("alpha", "beta"):
            assert env.admin("POST", "/admin/models", json={"name": name}).status_code == 201
        yield env


def test_a_lazy_load_carries_the_requests_waiting_for_it(env):
    w = env.worker("demand-1")
    try:
        w.gate.clear()  # loads stay "loading" until the gate opens: the requests pile up behind the first
        r = sync_client(env.redis_url)
        stream = keys.prefill_stream("alpha@1")
        for _ in range(3):  # entries some other gateway queued for it (taken away before anyone reads them)
            r.xadd(stream, {"job": b"x"})
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(env.complete, "alpha")
            until(lambda: w.ops("load"), "the first request's load command")
            r.delete(stream)
            w.gate.set()
            assert first.result().status_code == 200
        waiting = w.ops("load")[0].waiting
        assert waiting >= 4, waiting  # the request waiting here and the 3 queued jobs
        r = env.admin("POST", "/admin/models/beta/load")
        assert r.status_code in (200, 201), r.text
        assert [c.waiting for c in w.ops("load") if c.name == "beta"] == [0]  # an operator's load: no request
    finally:
        w.stop()
