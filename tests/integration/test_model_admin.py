"""The gateway side of the multi-model pool: admin API (auth, register/list/delete, confinement),
lazy load on the request path, 503 with the workers' reason, version swap, the reconciler.

Real Redis, the real gateway app on a real port, real HTTP. The workers are a fast scripted layer: a
``ScriptedWorker`` heartbeats a loading-capable WorkerInfo and answers ControlCommands; a load it accepts
starts a FakeWorker (gateway_harness.py) that serves the instance's stream. Real worker processes are
tested end to end in tests/e2e.
"""

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import requests

from kvrelay.gateway.control.reconciler import RECONCILER
from kvrelay.shared.repo.model_repo import MANIFEST
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult, InstanceStatus, ModelSpec, WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import REPLY, FakeWorker, GatewayServer, build_tokenizer, gateway_config

pytestmark = pytest.mark.timeout(120)

ADMIN_KEY = "admin-key-0123456789abcdef"
OOM = "not enough memory: needs 2.0 GiB of weights + 0.1 GiB KV, 0.5 GiB free"


@dataclasses.dataclass
class InstanceWorker(FakeWorker):
    """A FakeWorker serving one repository instance ("name@3") under its client name. It does not
    heartbeat: the ScriptedWorker that loaded it reports the instance, in its own role."""

    served: str = ""
    version: int = 0

    def model_info(self):
        return dataclasses.replace(super().model_info(), served_name=self.served, version=self.version)

    def _heartbeat(self, r) -> None:
        pass


class ScriptedWorker:
    """Heartbeats like a worker started with --model-repo and obeys load/unload. ``refuse`` answers every
    load with that error; clearing ``gate`` holds loads in state "loading" until it is set again."""

    def __init__(self, redis_url: str, tokenizer_dir: Path, worker_id: str, role: str = "unified",
                 refuse: str = ""):
        self.redis_url, self.tokenizer_dir, self.worker_id, self.role = redis_url, tokenizer_dir, worker_id, role
        self.refuse = refuse
        self.gate = threading.Event()
        self.gate.set()
        self.commands: list[ControlCommand] = []
        self.states: dict[str, InstanceStatus] = {}
        self.serving: dict[str, InstanceWorker] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._redis = sync_client(redis_url)

    def start(self) -> "ScriptedWorker":
        self._heartbeat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.gate.set()
        self._thread.join(5)
        for worker in list(self.serving.values()):
            worker.stop()
        self._redis.delete(keys.worker_key(self.worker_id))
        self._redis.srem(keys.WORKERS_INDEX, self.worker_id)

    def ops(self, op: str) -> list[ControlCommand]:
        with self._lock:
            return [c for c in self.commands if c.op == op]

    def _heartbeat(self) -> None:
        with self._lock:
            states = list(self.states.values())
        info = WorkerInfo(worker_id=self.worker_id, role=self.role, zmq_addr="tcp://127.0.0.1:1",
                          models=[s.instance for s in states if s.state == "ready"], free_blocks=100,
                          total_blocks=100, running=0, waiting=0, pid=0, host="test", started=time.time(),
                          heartbeat=time.time(), instances=states, weights_budget=1 << 30,
                          weights_used=len(states) << 20, can_load=True)
        self._redis.set(keys.worker_key(self.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
        self._redis.sadd(keys.WORKERS_INDEX, self.worker_id)

    def _answer(self, cmd: ControlCommand, ok: bool, error: str = "") -> None:
        result = ControlResult(command_id=cmd.command_id, worker_id=self.worker_id, instance=cmd.instance, ok=ok,
                               error=error)
        self._redis.set(keys.control_result_key(cmd.command_id), encode(result), ex=keys.CONTROL_RESULT_TTL_S)

    def _load(self, cmd: ControlCommand) -> None:
        self.gate.wait()
        if self._stop.is_set():
            return
        worker = InstanceWorker(self.redis_url, self.tokenizer_dir, model=cmd.instance,
                                worker_id=f"{self.worker_id}/{cmd.instance}", served=cmd.name,
                                version=cmd.version).start()
        with self._lock:
            self.serving[cmd.instance] = worker
            self.states[cmd.instance].state = "ready"
        self._heartbeat()
        self._answer(cmd, True)

    def _handle(self, cmd: ControlCommand) -> None:
        with self._lock:
            self.commands.append(cmd)
        if cmd.op == "load":
            if self.refuse:
                return self._answer(cmd, False, self.refuse)
            with self._lock:
                if cmd.instance in self.states:  # idempotent, like the real worker
                    return self._answer(cmd, True)
                self.states[cmd.instance] = InstanceStatus(instance=cmd.instance, name=cmd.name, version=cmd.version,
                                                           state="loading", pinned=cmd.pinned)
            self._heartbeat()
            threading.Thread(target=self._load, args=(cmd,), daemon=True).start()
        else:
            with self._lock:
                self.states.pop(cmd.instance, None)
                worker = self.serving.pop(cmd.instance, None)
            if worker is not None:
                worker.stop()
            self._heartbeat()
            self._answer(cmd, True)

    def _run(self) -> None:
        beat = time.monotonic()
        while not self._stop.is_set():
            data = self._redis.rpop(keys.control_key(self.worker_id))
            if data is not None:
                self._handle(decode(data, ControlCommand))
                continue
            if time.monotonic() - beat > 0.5:
                self._heartbeat()
                beat = time.monotonic()
            time.sleep(0.02)


def _own_db(url: str, db: int = 7) -> str:
    """A logical database of its own on the session Redis: these tests flush it freely."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return urlunsplit(parts._replace(query=f"db={db}"))
    return urlunsplit(parts._replace(path=f"/{db}"))


def _add_version(repo: Path, name: str, version: int) -> None:
    folder = repo / name / str(version)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({
        "name": name, "version": version, "dtype": "float32", "max_model_len": 96, "architecture": "LlamaForCausalLM",
        "files": {}, "source": "test", "created": 0.0}))


@dataclasses.dataclass
class Env:
    redis_url: str
    tokenizer_dir: Path
    server: GatewayServer
    api_key: str

    @property
    def url(self) -> str:
        return self.server.url

    def admin(self, method: str, path: str, **kw) -> requests.Response:
        return requests.request(method, f"{self.url}{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                timeout=60, **kw)

    def complete(self, model: str, prompt: str = "hello there") -> requests.Response:
        return requests.post(f"{self.url}/v1/completions", headers={"Authorization": f"Bearer {self.api_key}"},
                             json={"model": model, "prompt": prompt, "max_tokens": 64}, timeout=60)

    def worker(self, worker_id: str, **kw) -> ScriptedWorker:
        return ScriptedWorker(self.redis_url, self.tokenizer_dir, worker_id, **kw).start()

    def reconcile(self) -> bool:
        import asyncio

        app = self.server.app
        return asyncio.run_coroutine_threadsafe(app[RECONCILER].run_once(), self.server.loop).result(60)

    def model(self, name: str) -> dict | None:
        data = self.admin("GET", "/admin/models").json()["data"]
        return next((m for m in data if m["name"] == name), None)


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    url = _own_db(redis_url)
    sync_client(url).flushdb()
    tmp = tmp_path_factory.mktemp("model_admin")
    repo = tmp / "repo"
    for name, versions in {"alpha": [1], "beta": [1, 2], "gamma": [1], "delta": [1], "eps": [1, 2], "zeta": [1]}.items():
        for v in versions:
            _add_version(repo, name, v)
    _add_version(tmp / "outside", "secret", 1)
    (repo / "evil").symlink_to(tmp / "outside" / "secret")  # evil/1/manifest exists, but outside the repo
    _add_version(repo, "linked", 1)  # a file of the version is a link out of the repository
    (repo / "linked" / "1" / "config.json").symlink_to(tmp / "outside" / "secret" / "1" / MANIFEST)
    _add_version(repo, "renamed", 1)  # a manifest describing another model, or another version
    _add_version(repo, "renumbered", 2)
    for name, version, other in (("renamed", 1, {"name": "alpha"}), ("renumbered", 2, {"version": 1})):
        manifest = repo / name / str(version) / MANIFEST
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **other}))
    _add_version(repo, "shared", 1)  # a link to a sibling version's file stays inside: allowed
    (repo / "shared" / "1" / "model.safetensors").write_bytes(b"weights")
    _add_version(repo, "shared", 2)
    (repo / "shared" / "2" / "model.safetensors").symlink_to(Path("..") / "1" / "model.safetensors")
    server = GatewayServer(gateway_config(url, admin_key=ADMIN_KEY, model_repo=str(repo), model_load_timeout=15.0,
                                          reconcile_interval_s=0.0)).start()
    try:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert requests.post(f"{server.url}/admin/tenants", json={"name": "t1"}, headers=headers).status_code == 201
        key = requests.post(f"{server.url}/admin/keys", json={"tenant": "t1"}, headers=headers).json()["key"]
        yield Env(url, build_tokenizer(tmp / "tokenizer"), server, key)
    finally:
        server.stop()


@pytest.fixture
def workers(env) -> Iterator[Callable[..., ScriptedWorker]]:
    started: list[ScriptedWorker] = []

    def start(worker_id: str, **kw) -> ScriptedWorker:
        started.append(env.worker(worker_id, **kw))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def until(predicate: Callable[[], object], what: str, bound_s: float = 15.0) -> None:
    """A bound on waiting for something asynchronous, not a timing assertion."""
    end = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.05)


def test_admin_models_needs_the_admin_key(env):
    r = requests.get(f"{env.url}/admin/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    tenant = {"Authorization": f"Bearer {env.api_key}"}
    r = requests.post(f"{env.url}/admin/models", json={"name": "eps"}, headers=tenant)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    for method, path in (("DELETE", "/admin/models/eps"), ("POST", "/admin/models/eps/swap")):
        assert requests.request(method, f"{env.url}{path}", headers=tenant).status_code == 403
    assert env.admin("GET", "/admin/models").status_code == 200


def test_register_list_delete(env):
    r = env.admin("POST", "/admin/models", json={"name": "eps", "version": 1, "keep_alive_s": 30})
    assert r.status_code == 201, r.text
    assert r.json()["version"] == 1 and r.json()["instance"] == "eps@1" and r.json()["loading"] is False
    assert env.admin("POST", "/admin/models", json={"name": "eps", "keep_alive_s": 60}).status_code == 200
    r = env.admin("POST", "/admin/models", json={"name": "eps", "version": 2})
    assert r.status_code == 409 and "swap" in r.json()["error"]["message"]
    listed = env.model("eps")
    assert listed["registered"] and listed["version"] == 1 and listed["keep_alive_s"] == 60
    assert listed["instances"] == [{"instance": "eps@1", "version": 1, "workers": [], "queue_depth": 0,
                                    "active": True}]
    models = requests.get(f"{env.url}/v1/models", headers={"Authorization": f"Bearer {env.api_key}"}).json()
    assert "eps" in [m["id"] for m in models["data"]]
    assert not any("@" in m["id"] for m in models["data"])
    r = env.admin("DELETE", "/admin/models/eps")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert env.model("eps") is None
    assert env.admin("DELETE", "/admin/models/eps").status_code == 404


@pytest.mark.parametrize("body", [
    {"name": "../alpha"},
    {"name": "/etc/passwd"},
    {"name": "alpha/../../x"},
    {"name": "evil"},  # a symlink out of the repository
    {"name": "linked"},  # its config.json links out of the repository
    {"name": "renamed"},  # its manifest names another model
    {"name": "renumbered", "version": 2},  # its manifest names another version
    {"name": "nosuch"},
    {"name": "alpha", "version": 9},
    {"name": "alpha", "path": "/tmp/weights"},  # the API never loads from a path
    {"name": "alpha", "url": "https://example.com/model.safetensors"},
])
def test_register_rejects_what_is_not_a_repository_version(env, body):
    r = env.admin("POST", "/admin/models", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert env.model(body["name"]) is None


def test_the_refusal_names_the_file(env):
    r = env.admin("POST", "/admin/models", json={"name": "linked"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "linked v1: config.json resolves outside the model repository"
    r = env.admin("POST", "/admin/models", json={"name": "renumbered", "version": 2})
    assert r.status_code == 400 and f"renumbered/2/{MANIFEST} describes 'renumbered' version 1" in r.text


def test_a_link_to_a_sibling_version_is_allowed(env):
    r = env.admin("POST", "/admin/models", json={"name": "shared", "version": 2})
    try:
        assert r.status_code == 201, r.text
    finally:
        env.admin("DELETE", "/admin/models/shared")


def test_admin_paths_with_bad_names_or_versions(env):
    assert env.admin("POST", "/admin/models/evil/load").status_code == 404  # never registered
    assert env.admin("POST", "/admin/models/a%20b/load").status_code == 400
    env.admin("POST", "/admin/models", json={"name": "eps", "version": 1})
    try:
        r = env.admin("POST", "/admin/models/eps/swap", json={"version": 9})
        assert r.status_code == 400 and "no version 9" in r.json()["error"]["message"]
        assert env.admin("POST", "/admin/models/eps/swap", json={"version": "../2"}).status_code == 400
    finally:
        env.admin("DELETE", "/admin/models/eps")


def _jobs(worker: ScriptedWorker, instance: str) -> list:
    served = worker.serving.get(instance)
    return list(served.jobs) if served else []


def test_lazy_load_on_first_request(env, workers):
    w = workers("loader-1")
    assert env.admin("POST", "/admin/models", json={"name": "alpha"}).status_code == 201
    assert w.ops("load") == []  # registering a model loaded on demand loads nothing
    r = env.complete("alpha")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == REPLY
    (load,) = w.ops("load")
    assert (load.name, load.version, load.path) == ("alpha", 1, "")
    (job,) = _jobs(w, "alpha@1")
    assert job.model == "alpha@1"  # the stream and job carry the instance key
    # the next request finds it loaded: no second load
    assert env.complete("alpha").status_code == 200 and len(w.ops("load")) == 1
    entry = env.model("alpha")
    (inst,) = entry["instances"]
    assert inst["instance"] == "alpha@1" and inst["active"]
    assert {(x["worker_id"], x["state"]) for x in inst["workers"]} >= {("loader-1", "ready")}


def test_responses_show_the_clients_model_name(env, workers):
    workers("loader-2")
    env.admin("POST", "/admin/models", json={"name": "alpha"})
    r = env.complete("alpha")
    assert r.status_code == 200 and r.json()["model"] == "alpha"


def test_503_with_the_workers_reason_when_every_worker_refuses(env, workers):
    a, b = workers("full-a", refuse=OOM), workers("full-b", refuse=OOM)
    assert env.admin("POST", "/admin/models", json={"name": "gamma"}).status_code == 201
    r = env.complete("gamma")
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) > 0
    message = r.json()["error"]["message"]
    assert "not enough memory" in message and "full-a" in message and "full-b" in message
    assert len(a.ops("load")) == 1 and len(b.ops("load")) == 1  # each tried once, then the next
    # the admin load says the same, synchronously
    r = env.admin("POST", "/admin/models/gamma/load")
    assert r.status_code == 503 and "not enough memory" in r.json()["error"]["message"]


def test_503_when_no_worker_can_load(env):
    env.admin("POST", "/admin/models", json={"name": "zeta"})
    r = env.complete("zeta")
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert "can load models" in r.json()["error"]["message"]


def test_prefill_and_decode_workers_each_get_a_load(env, workers):
    p, d = workers("pf-1", role="prefill"), workers("dc-1", role="decode")
    env.admin("POST", "/admin/models", json={"name": "delta"})
    r = env.admin("POST", "/admin/models/delta/load")
    assert r.status_code == 200, r.text
    assert [c.instance for c in p.ops("load")] == ["delta@1"] and [c.instance for c in d.ops("load")] == ["delta@1"]
    env.admin("DELETE", "/admin/models/delta")
    until(lambda: p.ops("unload") and d.ops("unload"), "unload commands after DELETE")
    assert p.ops("unload")[0].drain and d.ops("unload")[0].drain


def test_swap_flips_only_once_the_new_version_is_ready(env, workers):
    w = workers("swapper-1")
    env.admin("POST", "/admin/models", json={"name": "beta", "version": 1})
    assert env.complete("beta").status_code == 200
    assert [j.model for j in _jobs(w, "beta@1")] == ["beta@1"]

    w.gate.clear()  # the new version stays "loading" until the test lets it finish
    swap: dict = {}
    thread = threading.Thread(target=lambda: swap.update(r=env.admin("POST", "/admin/models/beta/swap",
                                                                     json={"version": 2})))
    thread.start()
    try:
        until(lambda: any(c.instance == "beta@2" for c in w.ops("load")), "the swap's load command")
        # still loading: the spec is unchanged and new requests keep going to version 1
        assert env.model("beta")["version"] == 1
        assert env.complete("beta").status_code == 200
        assert len(_jobs(w, "beta@1")) == 2 and not _jobs(w, "beta@2")
    finally:
        w.gate.set()
        thread.join(60)
    r = swap["r"]
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["previous_version"] == 1 and r.json()["swapped"]
    assert [u["instance"] for u in r.json()["unloads"]] == ["beta@1"]
    until(lambda: w.ops("unload"), "the old version's unload")
    (unload,) = w.ops("unload")
    assert unload.instance == "beta@1" and unload.drain  # the old version drains, not dropped
    assert env.complete("beta").status_code == 200
    assert [j.model for j in _jobs(w, "beta@2")] == ["beta@2"] and len(_jobs(w, "beta@1")) <= 2
    # the reconciler clears previous_version once no worker holds version 1
    until(lambda: "beta@1" not in w.states, "the scripted worker unloading beta@1")
    assert env.reconcile()
    assert env.model("beta")["previous_version"] == 0


def test_reconciler_loads_pinned_models(env, workers):
    w = workers("keeper-1")
    # written straight to Redis, as `kvrelay serve --config` or another gateway would
    spec = ModelSpec(name="delta", version=1, pinned=True)
    r = sync_client(env.redis_url)
    r.set(keys.registry_key("delta"), encode(spec))
    r.sadd(keys.REGISTRY_INDEX, "delta")
    assert w.ops("load") == []
    assert env.reconcile()
    (load,) = [c for c in w.ops("load") if c.instance == "delta@1"]
    assert load.pinned
    until(lambda: any(x["state"] == "ready" for i in env.model("delta")["instances"] for x in i["workers"]),
          "delta ready")
    assert env.reconcile()  # loaded already: nothing more to do
    assert len([c for c in w.ops("load") if c.instance == "delta@1"]) == 1
    r = env.admin("POST", "/admin/models/delta/unload")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_pinned"
    env.admin("DELETE", "/admin/models/delta")


def test_register_pinned_loads_at_once(env, workers):
    w = workers("keeper-2")
    r = env.admin("POST", "/admin/models", json={"name": "eps", "version": 2, "pinned": True})
    assert r.status_code == 201 and r.json()["loading"] is True
    until(lambda: any(c.instance == "eps@2" for c in w.ops("load")), "the pinned model's load command")
    env.admin("DELETE", "/admin/models/eps")


def test_admin_openapi_describes_every_admin_route_and_only_to_the_admin(env):
    from kvrelay.gateway.routes import ROUTES

    public = requests.get(f"{env.url}/openapi.json", headers={"Authorization": f"Bearer {env.api_key}"}).json()
    assert not [p for p in public["paths"] if p.startswith("/admin")]
    assert requests.get(f"{env.url}/admin/openapi.json").status_code == 401
    full = env.admin("GET", "/admin/openapi.json").json()
    routes = {(r.method.lower(), r.path) for r in ROUTES if r.path.startswith("/admin")}
    described = {(m, p) for p, ops in full["paths"].items() if p.startswith("/admin") for m in ops}
    assert described == routes
    assert {"/admin/tenants", "/admin/keys", "/admin/keys/{id}", "/admin/usage"} <= full["paths"].keys()
