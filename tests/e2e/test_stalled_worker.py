"""A unified worker whose engine step hangs, beside a healthy one, behind a gateway with a short
--stalled-step-timeout-s: its heartbeat goes on (it does not wait for steps) and says how long the step has run,
so the gateway marks it stalled in /admin/models (logged once) and routes no new job to it: prompts whose
prefix affinity names it complete on its peer. Released, it steps again and is marked so. The hang (while a
file exists, once the engine has work) stands in for a GPU hang or a deadlocked kernel: Python run before the
CLI in the worker's process."""

import concurrent.futures
import json
import random
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from kvrelay.gateway.control.routing import Policy, route
from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE, TINY_VOCAB

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ADMIN_KEY = "admin-key-for-stalled-worker-tests"
TENANT = "tests"
STALLED_AFTER_S = 3  # far under a hang's length, far over a tiny model's step
BLOCK = 8  # TINY_ENGINE's --block-size

_HELD = """
import os, time
from kvrelay.shared.engine.engine_core import EngineCore
step = EngineCore.step
def held_while_flagged(self):
    if self.has_unfinished() and os.path.exists({flag!r}):
        print("the held step begins", flush=True)
        while os.path.exists({flag!r}):
            time.sleep(0.05)
        print("the held step ends", flush=True)
    return step(self)
EngineCore.step = held_while_flagged
"""


def _admin(port: int, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"{}")


def _workers(c: Cluster) -> dict[str, dict]:
    return {w["worker_id"]: w for w in _admin(c.port, "GET", "/admin/models")["workers"]}


def _wait(what: str, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.1)


def _prompts_routed_to(c: Cluster, worker_id: str, n: int) -> list[list[int]]:
    """``n`` prompts the gateway's router sends to ``worker_id`` while both workers step (the same function, over
    the workers' own heartbeat records, in the tenant's cache namespace)."""
    workers = [c.worker("uok"), c.worker("ustuck")]
    model = workers[0].models[0]
    salt = c.redis.hget(keys.tenant_key(TENANT), "cache_salt").decode()
    rng = random.Random(11)
    out = []
    while len(out) < n:
        prompt = [rng.randrange(100, TINY_VOCAB) for _ in range(3 * BLOCK)]
        if route(prompt, model, BLOCK, TENANT, salt, workers, {}, Policy()) == worker_id:
            out.append(prompt)
    return out


def _start(cluster: Cluster, hang_flag: Path) -> openai.OpenAI:
    """The gateway, workers uok and ustuck (whose step hangs while ``hang_flag`` exists), ready; a tenant's client."""
    # --registry-cache-s 0: each request routes over the workers' records as Redis holds them, as
    # _prompts_routed_to reads them; a view cached from before both workers were up routes elsewhere
    cluster.start_gateway(extra=["--admin-key", ADMIN_KEY, "--stalled-step-timeout-s", str(STALLED_AFTER_S),
                                 "--request-timeout", "60", "--registry-cache-s", "0"])
    cluster.start_worker("unified", "uok")
    cluster.start_worker("unified", "ustuck", prelude=_HELD.format(flag=str(hang_flag)))
    cluster.wait_ready(timeout=300)
    _wait("both workers at the gateway", lambda: {"uok", "ustuck"} <= set(_workers(cluster)))
    _admin(cluster.port, "POST", "/admin/tenants", {"name": TENANT})
    key = _admin(cluster.port, "POST", "/admin/keys", {"tenant": TENANT})["key"]
    return openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0, timeout=120)


def test_new_requests_skip_a_worker_whose_step_hangs_and_complete_on_its_peer(tiny_model_dir, redis_url, tmp_path):
    flag = tmp_path / "hang"
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    try:
        client = _start(cluster, flag)
        held, *later = _prompts_routed_to(cluster, "ustuck", 4)
        flag.touch()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(client.completions.create, model="tiny", prompt=held, max_tokens=4)  # its step hangs
            _wait("the held step", lambda: "the held step begins" in cluster.log("ustuck"))
            _wait("ustuck marked stalled", lambda: _workers(cluster)["ustuck"]["stalled"])
            texts = [client.completions.create(model="tiny", prompt=p, max_tokens=4).choices[0].text for p in later]
            listed = _workers(cluster)
            flag.unlink()
            _wait("ustuck stepping again", lambda: not _workers(cluster)["ustuck"]["stalled"])
        gateway_log, stuck_log = cluster.log("gateway"), cluster.log("ustuck")
    finally:
        flag.unlink(missing_ok=True)  # a held step returns, so its worker can stop
        cluster.stop()
        cluster.redis.flushall()  # the tenant made here would make later gateways on the session's Redis want keys
    assert len(texts) == 3 and all(texts)
    assert listed["ustuck"]["step_age_s"] > STALLED_AFTER_S
    assert not listed["uok"]["stalled"]
    assert gateway_log.count("'ustuck' is stalled") == 1  # once per stall, not per request
    assert "'ustuck' steps again" in gateway_log
    assert "the held step ends" in stuck_log
