"""Many models on one worker pair (issue #5), with real processes, Redis, HTTP and the openai SDK:
three models served at once by one prefill and one decode worker; lazy loading and eviction under a
weights budget (never the pinned model); a version swap under continuous load with zero failed
requests; corrupt weights refused while the other models keep serving."""

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from kvrelay.serve_config import load_serve_config
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.protocol import instance_key
from kvrelay.shared.worker.directory import live_workers
from tests.e2e.cluster import Cluster
from tests.e2e.model_variants import PROMPT, offline_text, variant

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-for-multi-model-tests"
HANG_S = 120.0  # a hang bound, not a speed claim: what is waited for comes within seconds
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(48 << 20)]


def admin(port: int, method: str, path: str, body: dict | None = None, key: str | None = ADMIN_KEY):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def complete(client: openai.OpenAI, model: str, prompt=PROMPT) -> str:
    got = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert got.model == model and got.usage.completion_tokens == 8
    return got.choices[0].text


@pytest.fixture()
def repo(tmp_path, tiny_model_dir):
    return ModelRepository(tmp_path / "repo")


def start(cluster: Cluster, repo: ModelRepository, config: Path | None, extra: list[str] = ()) -> openai.OpenAI:
    cluster.redis.flushall()
    common = ["--redis-url", cluster.redis_url, "--model-repo", str(repo.root), *ENGINE, *extra]
    for role, wid in (("prefill", "p1"), ("decode", "d1")):
        argv = [f"{role}-worker", "--worker-id", wid, *common] + (["--config", str(config)] if config else [])
        cluster._spawn(wid, argv)
    cluster.start_gateway(extra=["--model-repo", str(repo.root), "--admin-key", ADMIN_KEY,
                                 "--model-load-timeout", "120"])
    cluster.wait_ready()
    # with an admin key the API wants tenant keys: one tenant for the tests' requests
    assert admin(cluster.port, "POST", "/admin/tenants", {"name": "tests"})[0] in (200, 201)
    status, body = admin(cluster.port, "POST", "/admin/keys", {"tenant": "tests"})
    assert status == 201, body
    if config is not None:
        _await_startup_models(cluster, config)
    return openai.OpenAI(base_url=cluster.base_url, api_key=body["key"], max_retries=0, timeout=180)


def _await_startup_models(cluster: Cluster, config: Path) -> None:
    """/ready only waits for models it knows should be up; the config's models are registered by the
    workers as they start (kvrelay serve waits the same way before it announces itself ready)."""
    _, models = load_serve_config(config)
    wanted = [instance_key(m.name, m.version) for m in models if not m.lazy]
    deadline = time.monotonic() + 120
    while True:
        workers = live_workers(cluster.redis)
        registered = {n.decode() for n in cluster.redis.smembers(keys.REGISTRY_INDEX)}
        if {m.name for m in models} <= registered and all(
                any(i in w.models and w.can_prefill for w in workers)
                and any(i in w.models and w.can_decode for w in workers) for i in wanted):
            return
        assert time.monotonic() < deadline, f"startup models {wanted} not served"
        time.sleep(0.2)


@pytest.fixture()
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, "", [], tmp_path)
    yield c
    c.stop()
    # the session's Redis is shared: the tenant `start` made would make every later gateway on it demand a key
    # (test files run two at a time in any order, so which file comes next is not known)
    c.redis.flushall()


def test_three_models_in_one_prefill_and_one_decode_worker(cluster, repo, tmp_path, tiny_model_dir,
                                                          tiny_model_dirs, smollm2_dir):
    gpt2 = tmp_path / "tiny-gpt2"
    shutil.copytree(tiny_model_dirs["gpt2"], gpt2)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, gpt2 / f.name)
    import_model(repo, str(tiny_model_dir), "tiny-llama", progress=False)
    import_model(repo, str(gpt2), "tiny-gpt2", progress=False)
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: tiny-llama, version: 1, precision: float32}}
  - {{name: tiny-gpt2, version: 1, precision: float32}}
  - {{name: smollm2, path: {smollm2_dir}, precision: float32, pinned: true}}
""")
    client = start(cluster, repo, cfg)
    for wid in ("p1", "d1"):
        info = cluster.worker(wid)
        assert sorted(info.models) == ["smollm2", "tiny-gpt2@1", "tiny-llama@1"]
        assert all(i.state == "ready" and i.kv_blocks > 0 for i in info.instances)
    deadline = time.monotonic() + 30  # the gateway's registry view is cached for half a second
    while {m.id for m in client.models.list().data} < {"tiny-llama", "tiny-gpt2", "smollm2"}:
        assert time.monotonic() < deadline, client.models.list()
        time.sleep(0.2)
    want = {"tiny-llama": offline_text(tiny_model_dir), "tiny-gpt2": offline_text(gpt2),
            "smollm2": offline_text(smollm2_dir)}
    results: dict[str, list[str]] = {m: [] for m in want}

    def ask(model: str) -> None:
        results[model].append(complete(client, model))

    threads = [threading.Thread(target=ask, args=(m,)) for m in want for _ in range(3)]  # interleaved
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for model, text in want.items():
        assert results[model] == [text] * 3, model
    status, body = admin(cluster.port, "GET", "/admin/models")
    assert status == 200, body
    by_name = {m["name"]: m for m in body["data"]}
    llama = by_name["tiny-llama"]["instances"][0]
    assert llama["instance"] == "tiny-llama@1" and llama["active"] and llama["queue_depth"] == 0
    assert sorted(w["role"] for w in llama["workers"]) == ["decode", "prefill"]
    assert all(w["state"] == "ready" and w["weight_bytes"] > 0 and w["kv_blocks"] > 0 for w in llama["workers"])
    assert all(w["overhead_bytes"] > 0 for w in llama["workers"])  # its rotary table, measured by its engine
    assert all(w["weights_used"] > 0 and w["kv_pool_bytes"] == 48 << 20 for w in body["workers"])
    # the pool may grow into the budget its models leave unused, and backs only what it committed
    assert all(0 < w["kv_committed_bytes"] <= w["kv_cap_bytes"] == w["kv_pool_bytes"] + w["weights_budget"]
               - w["weights_used"] - w["overhead_used"] for w in body["workers"]), body["workers"]


def until(done, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_S:g} s"
        time.sleep(0.1)


def advertised(cluster: Cluster, wid: str, want: list[str], bound_s: float = HANG_S) -> list[str]:
    """The worker's models as its heartbeat record says, once they are ``want`` (or at ``bound_s``): a load or an
    eviction only asks the heartbeat thread to publish soon, and a request may be answered before it has."""
    end = time.monotonic() + bound_s
    while (models := sorted(cluster.worker(wid).models)) != want and time.monotonic() < end:
        time.sleep(0.1)
    return models


def test_lazy_load_evicts_the_idle_model_never_the_pinned_one(cluster, repo, tmp_path, tiny_model_dir):
    for name, seed in (("pinned", 0), ("idle", 1), ("lazy", 2)):
        import_model(repo, str(variant(tiny_model_dir, tmp_path / name, seed)), name, progress=False)
    weights = sum(f.stat().st_size for f in (tmp_path / "pinned").glob("*.safetensors"))
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: pinned, version: 1, precision: float32, pinned: true}}
  - {{name: idle, version: 1, precision: float32}}
  - {{name: lazy, version: 1, precision: float32, load: lazy}}
""")
    # room for the weights of two models, not three
    client = start(cluster, repo, cfg, extra=["--weights-memory", str(int(weights * 2.5))])
    assert sorted(cluster.worker("p1").models) == ["idle@1", "pinned@1"]
    want = {n: offline_text(tmp_path / n) for n in ("pinned", "idle", "lazy")}
    assert complete(client, "idle") == want["idle"]
    time.sleep(1.5)  # "idle" now idle past the grace period; "pinned" was never used
    assert complete(client, "lazy") == want["lazy"]  # waits for the load, which evicts "idle"
    for wid in ("p1", "d1"):
        assert advertised(cluster, wid, ["lazy@1", "pinned@1"]) == ["lazy@1", "pinned@1"]
    assert complete(client, "pinned") == want["pinned"]
    time.sleep(1.5)
    assert complete(client, "idle") == want["idle"]  # loaded again, evicting "lazy", not "pinned"
    assert advertised(cluster, "p1", ["idle@1", "pinned@1"]) == ["idle@1", "pinned@1"]


def test_version_swap_under_load_fails_no_request(cluster, repo, tmp_path, tiny_model_dir):
    import_model(repo, str(tiny_model_dir), "chat", progress=False)
    import_model(repo, str(variant(tiny_model_dir, tmp_path / "v2", 5)), "chat", progress=False)
    v1, v2 = offline_text(tiny_model_dir), offline_text(tmp_path / "v2")
    assert v1 != v2
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: chat, version: 1, precision: float32}}
""")
    client = start(cluster, repo, cfg)
    seen: list[tuple[float, float, str]] = []  # (sent, answered, text)
    errors: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                text = complete(client, "chat")
                seen.append((sent, time.monotonic(), text))
            except BaseException as exc:  # every failure counts
                errors.append(exc)

    def answered(what: str, done) -> None:
        until(lambda: done() or errors, what)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    answered("an answer of the first version", lambda: seen)  # the swap comes under load
    status, body = admin(cluster.port, "POST", "/admin/models/chat/swap", {"version": 2})
    assert status == 200, body
    answered("an answer of the new version", lambda: any(text == v2 for *_, text in seen))
    switched = min(at for _, at, text in seen if text == v2)
    answered("requests sent after it", lambda: sum(sent > switched for sent, *_ in seen) >= 8)
    stop.set()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    texts = [text for *_, text in seen]
    assert set(texts) <= {v1, v2}
    assert v1 in texts
    # once the new version has answered, the old one answers no request sent after
    assert all(text == v2 for sent, _, text in seen if sent > switched)
    # nothing runs for the old version any more (every request was answered): the prefill worker unloads it
    # at its next turn, the decode worker once the prefill worker's record no longer holds it, and each
    # record says so at its next heartbeat
    until(lambda: not any("chat@1" in cluster.worker(w).models for w in ("p1", "d1")), "the old version to leave")
    assert [cluster.worker(w).models for w in ("p1", "d1")] == [["chat@2"], ["chat@2"]]


def test_corrupt_weights_fail_the_load_and_nothing_else(cluster, repo, tmp_path, tiny_model_dir):
    import_model(repo, str(tiny_model_dir), "good", progress=False)
    mv = import_model(repo, str(variant(tiny_model_dir, tmp_path / "bad", 9)), "bad", progress=False)
    weights = next(Path(mv.path).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-100:] = b"\x00" * 100  # flipped bytes: a corrupt copy, same size
    weights.write_bytes(bytes(data))
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: good, version: 1, precision: float32}}
""")
    client = start(cluster, repo, cfg)
    status, body = admin(cluster.port, "POST", "/admin/models", {"name": "bad", "version": 1})
    assert status in (200, 201), body
    status, body = admin(cluster.port, "POST", "/admin/models/bad/load")
    assert status >= 400 and "corrupt" in json.dumps(body), body
    with pytest.raises(openai.APIStatusError) as err:
        complete(client, "bad")
    assert err.value.status_code == 503 and "corrupt" in str(err.value)
    assert complete(client, "good") == offline_text(tiny_model_dir)
    for wid in ("p1", "d1"):
        assert cluster.worker(wid).models == ["good@1"]
    # the prefill side is asked first; its failure ends the load before the decode side is bothered (its
    # heartbeat record says so once the thread the failure woke has rewritten it)
    deadline = time.monotonic() + 30
    while not any(i.instance == "bad@1" and i.state == "failed" and "corrupt" in i.error
                  for i in cluster.worker("p1").instances):
        assert time.monotonic() < deadline, cluster.worker("p1").instances
        time.sleep(0.1)
    # and the admin API refuses what could reach outside the repository
    for bad in ({"name": "../etc", "version": 1}, {"name": "good", "version": 1, "path": "/etc"}):
        assert admin(cluster.port, "POST", "/admin/models", bad)[0] == 400
    assert admin(cluster.port, "GET", "/admin/models", key=None)[0] == 401
    assert cluster.redis.exists(keys.registry_key("good"))
