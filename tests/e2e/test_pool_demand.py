"""Models loaded by demand (issue #26), with real worker processes, Redis, HTTP and the openai SDK: a request
queued for a model that left every worker meanwhile waits for its reload instead of its deadline, and a
queue that grows for a model no worker holds has the model loaded before its jobs' deadlines (prewarm),
while a registered model nobody asks for stays unloaded."""

import json
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from kvrelay import LLM
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.directory import live_workers
from tests.e2e.cluster import Cluster
from tests.e2e.jobs import JobClient
from tests.e2e.model_variants import GREEDY, PROMPT, offline_text, variant

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-for-pool-demand-tests"
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(48 << 20)]
WAIT_S = 120  # generous: loads on a busy 2-core CI box


def _admin(port: int, method: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"{}")


def _start(cluster: Cluster, repo: ModelRepository, config: Path, gateway: list[str]) -> openai.OpenAI:
    cluster.redis.flushall()
    common = ["--redis-url", cluster.redis_url, "--model-repo", str(repo.root), "--config", str(config), *ENGINE]
    for role, wid in (("prefill", "p1"), ("decode", "d1")):
        cluster._spawn(wid, [f"{role}-worker", "--worker-id", wid, *common])
    cluster.start_gateway(extra=["--model-repo", str(repo.root), "--admin-key", ADMIN_KEY, *gateway])
    cluster.wait_ready()
    _admin(cluster.port, "POST", "/admin/tenants", {"name": "tests"})
    key = _admin(cluster.port, "POST", "/admin/keys", {"tenant": "tests"})["key"]
    return openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0, timeout=WAIT_S)


def _held(cluster: Cluster, instance: str) -> dict[str, str]:
    """worker id -> the instance's state there, for the live workers holding it."""
    return {w.worker_id: s.state for w in live_workers(cluster.redis) for s in w.instances if s.instance == instance}


def _wait(what, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


def _complete(client: openai.OpenAI, model: str) -> str:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return got.choices[0].text


def _complete_retrying_504(client: openai.OpenAI, model: str, attempts: int = 4) -> str:
    """``_complete`` for a request whose deadline is not what the test is about: a gateway's short
    --request-timeout is for the request under test, and on a loaded 2-core host a model's first requests
    have outrun it (504), so a 504 is retried, at most a few times."""
    for _ in range(attempts - 1):
        try:
            return _complete(client, model)
        except openai.InternalServerError as exc:
            if exc.status_code != 504:
                raise
    return _complete(client, model)


@pytest.fixture()
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, "", [], tmp_path)
    yield c
    c.stop()
    c.redis.flushall()  # the session's Redis is shared: the tenant made here would ask every later gateway for a key


@pytest.fixture()
def models(tmp_path, tiny_model_dir) -> tuple[ModelRepository, dict[str, Path]]:
    repo = ModelRepository(tmp_path / "repo")
    dirs = {name: variant(tiny_model_dir, tmp_path / name, seed) for name, seed in (("hot", 3), ("cold", 4), ("idle", 5))}
    for name, path in dirs.items():
        import_model(repo, str(path), name, progress=False)
    return repo, dirs


def test_request_queued_for_an_unloaded_model_waits_for_its_reload(cluster, models, tmp_path):
    repo, dirs = models
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: hot, version: 1, precision: float32}}
  - {{name: cold, version: 1, precision: float32}}
""")
    # a gateway whose view of the workers is a minute old (as after another gateway's or a keep-alive's unload),
    # a deadline far shorter than waiting out a load, and no prewarm (prewarm.py): the request loads it itself
    client = _start(cluster, repo, cfg, ["--registry-cache-s", "60", "--request-timeout", "1.5",
                                         "--model-load-timeout", str(WAIT_S), "--reconcile-interval-s", "0"])
    _wait(lambda: all(_held(cluster, i) == {"p1": "ready", "d1": "ready"} for i in ("hot@1", "cold@1")))
    want = offline_text(dirs["cold"])
    assert _complete_retrying_504(client, "cold") == want  # the gateway has seen cold@1 served
    for wid in ("p1", "d1"):  # another gateway unloads it behind this one's back
        cmd = ControlCommand(command_id=uuid.uuid4().hex, op="unload", name="cold", version=1, drain=False)
        cluster.redis.lpush(keys.control_key(wid), encode(cmd))
    _wait(lambda: not _held(cluster, "cold@1"))
    # queued for a model nobody holds: answered once it is loaded again, never a 504 at the 1.5 s deadline
    # (the reload and its answer take longer than 1.5 s here: the request runs on past its own deadline)
    assert _complete(client, "cold") == want
    assert _held(cluster, "cold@1") == {"p1": "ready", "d1": "ready"}
    assert "loading it again" in cluster.log("gateway")
    assert _complete_retrying_504(client, "hot") == offline_text(dirs["hot"])


def test_a_queue_for_a_model_no_worker_holds_prewarms_it_and_an_idle_model_stays_cold(cluster, models, tmp_path):
    repo, dirs = models
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: hot, version: 1, precision: float32}}
  - {{name: cold, version: 1, precision: float32, load: lazy}}
  - {{name: idle, version: 1, precision: float32, load: lazy}}
""")
    _start(cluster, repo, cfg, ["--reconcile-interval-s", "1"])
    _wait(lambda: _held(cluster, "hot@1") == {"p1": "ready", "d1": "ready"})
    assert not _held(cluster, "cold@1") and not _held(cluster, "idle@1")  # lazy: nobody asked yet
    # jobs in cold@1's queue and no request on any gateway waiting to load it (its gateway went away)
    jobs = JobClient(cluster.redis, "cold@1")
    try:
        for i in range(3):
            jobs.submit(f"queued-{i}", PROMPT, max_tokens=8)
        seen = jobs.wait([f"queued-{i}" for i in range(3)], timeout=WAIT_S)
    finally:
        jobs.close()
    want = LLM(model=str(dirs["cold"]), dtype="float32", max_model_len=256).generate(
        [{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    for s in seen:  # served, by the right model, before the jobs' deadline (JobClient: 120 s after queueing)
        assert s.finish_reason == "length" and s.tokens == list(want)
        assert s.end < s.arrival + 120
    assert _held(cluster, "cold@1") == {"p1": "ready", "d1": "ready"}
    assert "prewarming cold@1" in cluster.log("gateway")
    time.sleep(2)  # two more prewarm passes
    assert not _held(cluster, "idle@1")  # an empty queue: never prewarmed
    assert "idle@1" not in cluster.log("gateway")
