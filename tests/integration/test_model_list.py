"""``/v1/models`` lists exactly what a request is served for (gateway/api/model_list.py, from the same
``Served`` view request resolution decides from): a registered model is listed whether or not a worker
holds it, since a request loads it, with ``kvrelay.loaded`` saying which; a name a request gets a 404 for
is not listed.

Real Redis, the real gateway app on a real port, real HTTP; workers are model_pool_harness.py's scripted
layer, which loads and unloads on the gateway's commands.
"""

from collections.abc import Callable, Iterator

import pytest
import requests

from tests.integration.gateway_harness import REPLY
from tests.integration.model_pool_harness import Env, ScriptedWorker, add_version, model_pool, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("model_list")
    for name in ("lazy", "pinned"):
        add_version(tmp / "repo", name, 1)
    with model_pool(redis_url, tmp / "repo", tmp, db=8) as env:
        yield env


@pytest.fixture
def workers(env) -> Iterator[Callable[[str], ScriptedWorker]]:
    started: list[ScriptedWorker] = []

    def start(worker_id: str) -> ScriptedWorker:
        started.append(env.worker(worker_id))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def listed(env: Env) -> dict[str, dict]:
    r = requests.get(f"{env.url}/v1/models", headers={"Authorization": f"Bearer {env.api_key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def loaded(env: Env, name: str) -> bool | None:
    entry = listed(env).get(name)
    return None if entry is None else entry["kvrelay"]["loaded"]


def test_a_registered_model_is_listed_loaded_or_not_and_served(env, workers):
    w = workers("list-1")
    assert env.admin("POST", "/admin/models", json={"name": "lazy"}).status_code == 201
    entry = listed(env)["lazy"]
    assert entry["kvrelay"] == {"loaded": False, "registered": True}
    assert entry["version"] == 1
    r = env.complete("lazy")  # listed, so served: this request loads it
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY
    assert loaded(env, "lazy") is True
    # unloaded: still what a request is served for (it loads it again), now shown as not loaded
    assert env.admin("POST", "/admin/models/lazy/unload").status_code == 202
    until(lambda: loaded(env, "lazy") is False, "lazy listed as unloaded")
    assert env.complete("lazy").status_code == 200
    assert len(w.ops("load")) == 2
    env.admin("DELETE", "/admin/models/lazy")
    until(lambda: "lazy" not in listed(env), "lazy gone from the list once unregistered")
    assert env.complete("lazy").status_code == 404


def test_a_pinned_model_whose_workers_are_gone_is_listed_and_loaded_again(env, workers):
    first = workers("list-2")
    r = env.admin("POST", "/admin/models", json={"name": "pinned", "pinned": True})
    assert r.status_code == 201
    until(lambda: loaded(env, "pinned") is True, "the pinned model loaded at registration")
    first.stop()  # its only worker gone (a restart, an eviction): a request would load it elsewhere
    until(lambda: loaded(env, "pinned") is False, "pinned listed as not loaded")
    second = workers("list-3")
    r = env.complete("pinned")
    assert r.status_code == 200, r.text
    assert [c.instance for c in second.ops("load")] == ["pinned@1"]
    assert loaded(env, "pinned") is True
    env.admin("DELETE", "/admin/models/pinned")


def test_an_unknown_name_is_not_listed(env):
    assert "nosuch" not in listed(env)
    r = env.complete("nosuch")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # nothing listed is an instance key, nor a name no request could use
    assert all("@" not in name for name in listed(env))
