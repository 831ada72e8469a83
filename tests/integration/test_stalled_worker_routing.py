"""The real gateway beside a worker whose heartbeat says its engine loop has been in one step past
--stalled-step-timeout-s: a prompt whose prefix affinity names that worker goes to the shared stream, where a
stepping worker (the fake one) takes it; a model only stalled workers hold answers 503 + Retry-After naming
them, and /ready is 503 naming them (it counts the workers that step only), and /v1/models leaves it out until
a worker that steps holds it (a registered model no worker holds stays listed: its request loads it); /metrics
shows the stall. The
stalled worker is its heartbeat record and its private stream, as a real worker whose step hangs leaves them."""

import time

import pytest
import requests

from kvrelay.gateway.control.routing import Policy, route
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec, WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import MODEL, ready_after_tokenizers, running_stack

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 5.0
STUCK = "w-stuck"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("stalled"), stalled_step_timeout_s=TIMEOUT_S) as s:
        yield s


def _stalled(r, worker_id: str, model: str, step_age_s: float = 2 * TIMEOUT_S) -> None:
    """The heartbeat of a worker whose loop has been in one step for twice the timeout (``step_age_s``: for
    so long), and its private stream."""
    now = time.time()
    info = WorkerInfo(worker_id=worker_id, role="unified", models=[model], zmq_addr="tcp://127.0.0.1:1",
                      free_blocks=100, total_blocks=100, running=1, waiting=0, pid=1, host="h", started=now,
                      heartbeat=now, step_age_s=step_age_s)
    r.set(keys.worker_key(worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
    r.sadd(keys.WORKERS_INDEX, worker_id)
    stream = keys.prefill_worker_stream(model, worker_id)
    if not r.exists(stream):
        r.xgroup_create(stream, keys.PREFILL_GROUP, id="0", mkstream=True)


def _routed_to(r, worker_id: str, workers: list[str], block_size: int) -> list[int]:
    """A prompt of two full blocks the gateway's router sends to ``worker_id`` were every one of ``workers``
    stepping (the same function, over their heartbeat records)."""
    infos = [decode(r.get(keys.worker_key(w)), WorkerInfo) for w in workers]
    for token in range(10, 200):
        prompt = [token] * (2 * block_size)
        if route(prompt, MODEL, block_size, "default", None, infos, {}, Policy()) == worker_id:
            return prompt
    raise AssertionError(f"no prompt goes to {worker_id}")


def test_a_prompt_whose_affinity_names_a_stalled_worker_is_served_by_one_that_steps(stack):
    r = sync_client(stack.redis_url)
    try:
        _stalled(r, STUCK, MODEL)
        prompt = _routed_to(r, STUCK, [STUCK, stack.worker.worker_id], stack.worker.model_info().block_size)
        resp = requests.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                             timeout=60)
        assert resp.status_code == 200, resp.text
        assert r.xlen(keys.prefill_worker_stream(MODEL, STUCK)) == 0
        assert any(j.prompt_token_ids == prompt for j in stack.worker.jobs)
        scrape = requests.get(f"{stack.url}/metrics", timeout=30).text
        assert f'kvrelay_worker_stalled{{role="unified",worker_id="{STUCK}"}} 1.0' in scrape
        assert f'kvrelay_worker_stalled{{role="unified",worker_id="{stack.worker.worker_id}"}} 0.0' in scrape
    finally:
        r.delete(keys.worker_key(STUCK), keys.prefill_worker_stream(MODEL, STUCK))
        r.srem(keys.WORKERS_INDEX, STUCK)
        r.close()


def _publish(r, model: str, **fields) -> None:
    """The record of a model published directly (a worker given it by path), as its worker leaves it; with
    ``fields`` (``served_name``, ``version``), an instance of a registered model."""
    info = ModelInfo(name=model, path="/nonexistent", max_model_len=64, vocab_size=100, eos_token_ids=[0],
                     block_size=16, dtype="float32", **fields)
    r.set(keys.model_key(model), encode(info))
    r.sadd(keys.MODELS_INDEX, model)


def _forget(r, model: str) -> None:
    r.delete(keys.model_key(model), keys.worker_key(f"{model}-w"), keys.prefill_worker_stream(model, f"{model}-w"))
    r.srem(keys.MODELS_INDEX, model)
    r.srem(keys.WORKERS_INDEX, f"{model}-w")


def test_a_model_only_stalled_workers_hold_is_503_naming_them(stack):
    r = sync_client(stack.redis_url)
    only = "held-by-stalled"
    try:
        _publish(r, only)
        _stalled(r, f"{only}-w", only)
        resp = requests.post(f"{stack.url}/v1/completions", json={"model": only, "prompt": [1, 2]}, timeout=60)
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["Retry-After"]) > 0
        err = resp.json()["error"]
        assert err["code"] == "worker_stalled"
        assert f"{only}-w" in err["message"] and "stalled" in err["message"]
        assert "--stalled-step-timeout-s" in err["message"]
    finally:
        _forget(r, only)
        r.close()


def test_ready_is_503_while_a_models_only_workers_are_stalled_naming_them(stack):
    r = sync_client(stack.redis_url)
    only = "ready-stalled"
    try:
        assert ready_after_tokenizers(stack.url).status_code == 200
        _publish(r, only)
        _stalled(r, f"{only}-w", only)
        ready = requests.get(f"{stack.url}/ready", timeout=30)
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body["models"][only] == {"prefill_workers": 0, "decode_workers": 0}  # the routable ones
        assert body["models"][MODEL] == {"prefill_workers": 1, "decode_workers": 1}
        assert list(body["stalled"]) == [only]
        assert f"{only}-w" in body["stalled"][only] and "--stalled-step-timeout-s" in body["stalled"][only]
        _stalled(r, f"{only}-w", only, step_age_s=0.0)  # it steps again
        ready = ready_after_tokenizers(stack.url)
        assert ready.status_code == 200 and "stalled" not in ready.json(), ready.text
        assert ready.json()["models"][only] == {"prefill_workers": 1, "decode_workers": 1}
    finally:
        _forget(r, only)
        r.close()


def test_ready_counts_only_the_stepping_workers_of_a_model_some_of_which_step(stack):
    r = sync_client(stack.redis_url)
    try:
        _stalled(r, STUCK, MODEL)
        ready = ready_after_tokenizers(stack.url)
        assert ready.status_code == 200 and "stalled" not in ready.json(), ready.text
        assert ready.json()["models"][MODEL] == {"prefill_workers": 1, "decode_workers": 1}
    finally:
        r.delete(keys.worker_key(STUCK), keys.prefill_worker_stream(MODEL, STUCK))
        r.srem(keys.WORKERS_INDEX, STUCK)
        r.close()


def _listed(url: str) -> set[str]:
    resp = requests.get(f"{url}/v1/models", timeout=30)
    assert resp.status_code == 200, resp.text
    return {m["id"] for m in resp.json()["data"]}


def test_a_model_only_stalled_workers_hold_is_not_listed_until_a_worker_that_steps_holds_it(stack):
    r = sync_client(stack.redis_url)
    only = "list-stalled"
    peer = f"{only}-peer"
    try:
        _publish(r, only)
        _stalled(r, f"{only}-w", only)
        assert only not in _listed(stack.url)  # a request for it gets 503
        assert MODEL in _listed(stack.url)
        _stalled(r, peer, only, step_age_s=0.0)  # a second worker, one that steps
        assert only in _listed(stack.url)
    finally:
        r.delete(keys.worker_key(peer), keys.prefill_worker_stream(only, peer))
        r.srem(keys.WORKERS_INDEX, peer)
        _forget(r, only)
        r.close()


def test_a_registered_model_is_listed_unless_its_only_workers_are_stalled(stack):
    r = sync_client(stack.redis_url)
    spec = ModelSpec(name="reg-stalled", version=1)
    held_by = f"{spec.instance}-w"
    try:
        r.set(keys.registry_key(spec.name), encode(spec))
        r.sadd(keys.REGISTRY_INDEX, spec.name)
        assert spec.name in _listed(stack.url)  # no worker holds it: its request loads it
        _publish(r, spec.instance, served_name=spec.name, version=spec.version)
        _stalled(r, held_by, spec.instance)
        assert spec.name not in _listed(stack.url)
        resp = requests.post(f"{stack.url}/v1/completions", json={"model": spec.name, "prompt": [1, 2]}, timeout=60)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "worker_stalled", resp.text
        _stalled(r, held_by, spec.instance, step_age_s=0.0)  # it steps again
        assert spec.name in _listed(stack.url)
    finally:
        r.delete(keys.registry_key(spec.name))
        r.srem(keys.REGISTRY_INDEX, spec.name)
        _forget(r, spec.instance)
        r.close()
