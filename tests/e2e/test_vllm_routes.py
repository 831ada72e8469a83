"""vLLM's ``/version`` and SageMaker's ``/invocations`` on a real gateway with a prefill and a decode
worker (tiny model, CPU): the version is the installed kvrelay's; a chat body gets a chat completion, a
completion body a completion (whole and streamed), and a body of neither shape a 400 in OpenAI's shape.
With an admin key set, /invocations wants a tenant key as /v1/... does, and /version stays open."""

import time
from importlib import metadata

import httpx
import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow
MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_url, tmp_path_factory):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path_factory.mktemp("vllm-routes"))
    c.redis.flushall()
    with c.disaggregated():
        yield c


def url(c: Cluster, path: str) -> str:
    return f"http://127.0.0.1:{c.port}{path}"


def test_version_is_kvrelays(cluster):
    resp = httpx.get(url(cluster, "/version"), timeout=10)
    assert resp.status_code == 200
    assert resp.json() == {"version": metadata.version("kvrelay")}


def test_invocations_dispatches_by_body_shape(cluster):
    args = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    chat = httpx.post(url(cluster, "/invocations"), timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], **args})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 4

    completion = httpx.post(url(cluster, "/invocations"), json={"prompt": "Once upon a time", **args}, timeout=60)
    assert completion.status_code == 200, completion.text
    body = completion.json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] == 4

    with httpx.stream("POST", url(cluster, "/invocations"), timeout=60,
                      json={"prompt": "Hello", "stream": True, **args}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


@pytest.mark.parametrize("body", [{"model": MODEL, "max_tokens": 4}, ["not", "an", "object"]])
def test_invocations_without_either_shape_is_a_400(cluster, body):
    resp = httpx.post(url(cluster, "/invocations"), json=body, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "messages" in error["message"]
    assert error["param"] == "messages"


def test_invocations_validates_like_the_route_it_picks(cluster):
    resp = httpx.post(url(cluster, "/invocations"), json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                      timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_invocations_needs_a_tenant_key_when_the_api_does(tiny_model_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    port = c.start_gateway("locked", ["--admin-key", "admin-secret-0123456789"])
    try:
        client = httpx.Client(timeout=10)
        deadline = time.monotonic() + 30
        while True:  # up when it answers at all (no worker here, so not ready)
            try:
                client.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, c.log("locked")[-2000:]
                time.sleep(0.1)
        resp = client.post(f"http://127.0.0.1:{port}/invocations", json={"prompt": "x"})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert client.get(f"http://127.0.0.1:{port}/version").status_code == 200
    finally:
        c.stop()
