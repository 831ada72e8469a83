"""A request queued for a model that left its workers meanwhile (gateway/control/reload_wait.py), against
real Redis and the real gateway app, whose view of the workers is a minute old: the request loads the
model again and is answered; when no worker can take it, it ends at once with the workers' reason (503),
not with a 504 at its deadline. The workers are the scripted layer of model_pool_harness.py."""

import time
import uuid
from collections.abc import Iterator

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import REPLY
from tests.integration.model_pool_harness import Env, add_version, model_pool, until

pytestmark = pytest.mark.timeout(120)

OOM = "not enough memory to load alpha@1: needs 2.00 GiB of weights (free 0.50 of 4.00 GiB)"


@pytest.fixture
def env(redis_url, tmp_path) -> Iterator[Env]:
    add_version(tmp_path / "repo", "alpha", 1)
    # a deadline far shorter than the test's bounds: a request left to wait it out fails with 504
    with model_pool(redis_url, tmp_path / "repo", tmp_path, db=12, registry_cache_s=60.0,
                    request_timeout=5.0) as env:
        assert env.admin("POST", "/admin/models", json={"name": "alpha"}).status_code == 201
        yield env


def test_the_request_reloads_its_model_or_ends_with_the_workers_reason(env):
    w = env.worker("reload-1")
    try:
        assert env.complete("alpha").status_code == 200  # lazy load
        r = env.complete("alpha")  # the gateway's cached view now has alpha@1 served, for a minute
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY
        unload = ControlCommand(command_id=uuid.uuid4().hex, op="unload", name="alpha", version=1, drain=False)
        db = sync_client(env.redis_url)
        db.lpush(keys.control_key("reload-1"), encode(unload))  # another gateway's unload
        # answered once its instance stopped reading its queue: one still reading would take the next job and
        # vanish with it (worker_lost)
        until(lambda: db.exists(keys.control_result_key(unload.command_id)), "alpha@1 unloaded")
        w.refuse = OOM
        r = env.complete("alpha")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_unavailable" and OOM in error["message"]
        w.refuse = ""
        time.sleep(2.5)  # the failed load's reason answers for the instance for a moment (placement.py)
        r = env.complete("alpha")  # queued on the stale view again: loaded again, and answered
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY, r.text
        assert len(w.ops("load")) == 3
    finally:
        w.stop()
