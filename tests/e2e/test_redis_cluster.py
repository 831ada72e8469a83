"""kvrelay on a real three-master Redis Cluster (issue 28): a gateway and a unified worker, each as its own
process with its role's least-privilege user (``redis-cluster://`` URL), serve the smoke suite: chat,
streaming chat, a tenant with limits (the Lua admission script in cluster mode), admin model register,
load and unload, and a version swap; the keys they wrote spread over more than one master."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_cluster import parse
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE, TINY_POOL_ENGINE
from tests.e2e.model_variants import PROMPT, variant

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-for-redis-cluster-tests"
ENGINE = [a for a in TINY_POOL_ENGINE if a not in ("--served-model-name", "tiny")]


def admin(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def complete(client: openai.OpenAI, model: str) -> str:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert got.model == model and got.usage.completion_tokens == 6
    return got.choices[0].text


@pytest.fixture(scope="module")
def deployment(redis_cluster, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("redis-cluster")
    repo = ModelRepository(root / "repo")
    import_model(repo, str(tiny_model_dir), "chat", progress=False)
    import_model(repo, str(variant(tiny_model_dir, root / "v2", 5)), "chat", progress=False)
    import_model(repo, str(variant(tiny_model_dir, root / "other", 7)), "other", progress=False)
    cfg = root / "models.yaml"
    cfg.write_text(f"model_repo: {{type: local, path: {repo.root}}}\n"
                   "models:\n  - {name: chat, version: 1, precision: float32}\n")
    redis_cluster.flushall()
    c = Cluster(redis_cluster.url, "", [], root)
    c._spawn("u1", ["unified-worker", "--worker-id", "u1", "--model-repo", str(repo.root), "--config", str(cfg),
                    *ENGINE], redis_url=redis_cluster.role_url("worker"))
    c.port = port = free_port()
    c._spawn("gateway", ["gateway", "--port", str(port), "--model-repo", str(repo.root),
                         "--admin-key", ADMIN_KEY, "--model-load-timeout", "120"],
             redis_url=redis_cluster.role_url("gateway"))
    try:
        c.wait_ready(timeout=120)
        deadline = time.monotonic() + 60  # the worker registers its config's model as it starts
        while (w := c.worker("u1")) is None or "chat@1" not in w.models:
            assert time.monotonic() < deadline, c.log("u1")[-3000:]
            time.sleep(0.2)
        assert admin(port, "POST", "/admin/tenants", {"name": "tests"})[0] in (200, 201)
        status, body = admin(port, "POST", "/admin/keys", {"tenant": "tests"})
        assert status == 201, body
        yield c, openai.OpenAI(base_url=c.base_url, api_key=body["key"], max_retries=0, timeout=120)
    finally:
        c.stop()
        c.redis.close()
        redis_cluster.flushall()


def test_chat_and_streaming_chat(deployment):
    _, client = deployment
    messages = [{"role": "user", "content": "Say hello"}]
    got = client.chat.completions.create(model="chat", messages=messages, max_tokens=6, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 6 and got.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="chat", messages=messages, max_tokens=6, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == got.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_a_tenants_limits_hold(deployment):
    c, _ = deployment
    assert admin(c.port, "POST", "/admin/tenants", {"name": "limited", "rpm": 2})[0] in (200, 201)
    status, body = admin(c.port, "POST", "/admin/keys", {"tenant": "limited"})
    assert status == 201, body
    limited = openai.OpenAI(base_url=c.base_url, api_key=body["key"], max_retries=0, timeout=120)
    complete(limited, "chat")
    complete(limited, "chat")
    with pytest.raises(openai.RateLimitError) as err:
        complete(limited, "chat")
    assert err.value.body["code"] == "rate_limit_exceeded" or "rpm" in str(err.value)
    # the admission script's counters: one tenant's, one slot, on one of the masters
    assert c.redis.hlen(keys.limit_key("limited", "rpm")) >= 1
    status, usage = admin(c.port, "GET", "/admin/usage?tenant=limited")
    assert status == 200 and sum(row["requests"] for row in usage["data"]) == 2, usage


def test_admin_register_load_unload(deployment):
    c, client = deployment
    status, body = admin(c.port, "POST", "/admin/models", {"name": "other", "version": 1, "dtype": "float32"})
    assert status in (200, 201), body
    status, body = admin(c.port, "POST", "/admin/models/other/load")
    assert status == 200, body
    # the worker writes the load's result, then wakes its heartbeat thread to advertise the model
    deadline = time.monotonic() + 30
    while "other@1" not in c.worker("u1").models:
        assert time.monotonic() < deadline, c.worker("u1").models
        time.sleep(0.2)
    assert complete(client, "other") != complete(client, "chat")
    status, body = admin(c.port, "POST", "/admin/models/other/unload")
    assert status == 202, body
    deadline = time.monotonic() + 30
    while "other@1" in c.worker("u1").models:
        assert time.monotonic() < deadline, c.worker("u1").models
        time.sleep(0.2)
    status, body = admin(c.port, "DELETE", "/admin/models/other")
    assert status in (200, 202, 204), body
    assert not c.redis.exists(keys.registry_key("other"))


def test_version_swap(deployment):
    c, client = deployment
    v1 = complete(client, "chat")
    status, body = admin(c.port, "POST", "/admin/models/chat/swap", {"version": 2})
    assert status == 200, body
    deadline = time.monotonic() + 30  # the gateway's registry view is cached for a moment
    while (text := complete(client, "chat")) == v1:
        assert time.monotonic() < deadline, "still answered by version 1"
        time.sleep(0.2)
    deadline = time.monotonic() + 60  # the old version drains, then leaves the worker
    while "chat@1" in c.worker("u1").models:
        assert time.monotonic() < deadline, c.worker("u1").models
        time.sleep(0.3)
    assert c.worker("u1").models == ["chat@2"] and complete(client, "chat") == text


def test_the_keys_spread_over_the_masters(deployment, redis_cluster):
    held = [redis_cluster.node(i).dbsize() for i in range(len(parse(redis_cluster.url).nodes))]
    assert sum(1 for n in held if n) >= 2, held


def test_the_queue_metrics_read_the_cluster(deployment):
    c, client = deployment
    complete(client, "chat")
    with urllib.request.urlopen(f"http://127.0.0.1:{c.port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    depth = [line for line in text.splitlines() if line.startswith("kvrelay_queue_depth{")]
    assert depth and all(line.endswith(" 0.0") for line in depth), depth
    assert any(line.startswith("kvrelay_queue_oldest_age_seconds{") for line in text.splitlines())


def test_disaggregated_prefill_and_decode_workers(deployment, redis_cluster, tiny_model_dir):
    """The prefill -> decode handoff, and the workers' own streams, across the masters: a prefill and a
    decode worker join the deployment with another model."""
    c, client = deployment
    for role, wid in (("prefill", "p9"), ("decode", "d9")):
        c._spawn(wid, [f"{role}-worker", "--model", str(tiny_model_dir), "--worker-id", wid, *TINY_ENGINE],
                 redis_url=redis_cluster.role_url("worker"))
    try:
        for wid in ("p9", "d9"):
            c.wait_worker(wid)
        deadline = time.monotonic() + 30  # the gateway's worker view is cached for a moment
        while "tiny" not in {m.id for m in client.models.list().data}:
            assert time.monotonic() < deadline, client.models.list()
            time.sleep(0.2)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 6
        streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == got.choices[0].text
    finally:
        for wid in ("p9", "d9"):
            c.procs[wid].terminate()
            c.procs[wid].wait(30)

