"""The gateway side of the multi-model pool: admin API (auth, register/list/delete, confinement),
lazy load on the request path, 503 with the workers' reason, version swap, the reconciler.

Real Redis, the real gateway app on a real port, real HTTP; the workers are the scripted layer of
model_pool_harness.py.
"""

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from kvrelay.shared.repo.model_repo import MANIFEST
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ModelSpec
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import REPLY
from tests.integration.model_pool_harness import Env, ScriptedWorker, add_version, model_pool, until

pytestmark = pytest.mark.timeout(120)

OOM = "not enough memory: needs 2.0 GiB of weights + 0.1 GiB KV, 0.5 GiB free"


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("model_admin")
    repo = tmp / "repo"
    for name, versions in {"alpha": [1], "beta": [1, 2], "gamma": [1], "delta": [1], "eps": [1, 2], "zeta": [1]}.items():
        for v in versions:
            add_version(repo, name, v)
    add_version(tmp / "outside", "secret", 1)
    (repo / "evil").symlink_to(tmp / "outside" / "secret")  # evil/1/manifest exists, but outside the repo
    add_version(repo, "linked", 1)  # a file of the version is a link out of the repository
    (repo / "linked" / "1" / "config.json").symlink_to(tmp / "outside" / "secret" / "1" / MANIFEST)
    add_version(repo, "renamed", 1)  # a manifest describing another model, or another version
    add_version(repo, "renumbered", 2)
    for name, version, other in (("renamed", 1, {"name": "alpha"}), ("renumbered", 2, {"version": 1})):
        manifest = repo / name / str(version) / MANIFEST
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **other}))
    add_version(repo, "shared", 1)  # a link to a sibling version's file stays inside: allowed
    (repo / "shared" / "1" / "model.safetensors").write_bytes(b"weights")
    add_version(repo, "shared", 2)
    (repo / "shared" / "2" / "model.safetensors").symlink_to(Path("..") / "1" / "model.safetensors")
    with model_pool(redis_url, repo, tmp, db=7) as env:
        yield env


@pytest.fixture
def workers(env) -> Iterator[Callable[..., ScriptedWorker]]:
    started: list[ScriptedWorker] = []

    def start(worker_id: str, **kw) -> ScriptedWorker:
        started.append(env.worker(worker_id, **kw))
        return started[-1]

    yield start
    for w in started:
        w.stop()


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
    assert r.status_code == 200 and r.json()["model"] == "alpha", r.text


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
    r = env.complete("beta")
    assert r.status_code == 200, r.text
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
