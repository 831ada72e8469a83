"""The gateway's failure paths: every error in OpenAI's shape with the right status, aborts published for
abandoned requests, timeouts that end cleanly instead of hanging."""

import asyncio
import json
import socket
import time

import aiohttp
import openai
import pytest
import requests
import zmq

from kvrelay.gateway.state import DISPATCHER
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import Abort, ModelInfo, WorkerInfo
from kvrelay.shared.wire.redis_conn import async_client, sync_client
from tests.integration.gateway_harness import (
    MAX_MODEL_LEN,
    MODEL,
    GatewayServer,
    gateway_config,
    ready_after_tokenizers,
    running_stack,
)
from tests.zmq_secret import CURVE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("gateway-errors")) as s:
        yield s


def _post(stack, path: str, body=None, **kw) -> requests.Response:
    return requests.post(f"{stack.url}{path}", json=body, **kw)


def _error(r: requests.Response, status: int, type_: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"echo": True, "logprobs": 21, "stream": True}, "logprobs"),
    ({"logprobs": -2}, "logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"stop": [1]}, "stop"),
])
def test_bad_completion_params(stack, body, param):
    _error(_post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", **body}), 400,
           "invalid_request_error", param)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": "hi"}, "messages"),
])
def test_bad_chat_params(stack, body, param):
    _error(_post(stack, "/v1/chat/completions", {**CHAT, **body}), 400, "invalid_request_error", param)


@pytest.mark.parametrize("prompt", ["", [], [[]], [""]])
def test_empty_prompt(stack, prompt):
    _error(_post(stack, "/v1/completions", {"model": MODEL, "prompt": prompt}), 400, "invalid_request_error", "prompt")


def test_out_of_vocabulary_token_id(stack):
    vocab = len(stack.tokenizer)
    for bad in (vocab, -1):
        err = _error(_post(stack, "/v1/completions", {"model": MODEL, "prompt": [1, bad]}), 400,
                     "invalid_request_error", "prompt")
        assert str(bad) in err["message"]


def test_prompt_too_long(stack):
    long_prompt = [5] * (MAX_MODEL_LEN - 10)
    err = _error(_post(stack, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 20}), 400,
                 "invalid_request_error", "max_tokens")
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN - 10) in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(stack, "/v1/completions", {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN}), 400,
                 "invalid_request_error", "prompt")
    assert str(MAX_MODEL_LEN) in err["message"]


def test_malformed_bodies(stack):
    url = f"{stack.url}/v1/completions"
    headers = {"Content-Type": "application/json"}
    err = _error(requests.post(url, data=b'{"model": "tiny", "prompt": ', headers=headers), 400,
                 "invalid_request_error")
    assert "JSON" in err["message"]
    err = _error(requests.post(url, data=b'{"model": "\xff\xfe"}', headers=headers), 400, "invalid_request_error")
    assert "UTF-8" in err["message"]
    _error(requests.post(url, data=b"[1, 2]", headers=headers), 400, "invalid_request_error")
    # Python's json would read NaN; a NaN temperature would pass every range check.
    err = _error(requests.post(url, data=b'{"model": "tiny", "prompt": "x", "temperature": NaN}', headers=headers),
                 400, "invalid_request_error")
    assert "NaN" in err["message"]


def test_body_too_large(stack):
    big = {"model": MODEL, "prompt": "x" * (stack.server.config.max_body_size + 10)}
    err = _error(_post(stack, "/v1/completions", big), 413, "invalid_request_error")
    assert err["code"] == "request_too_large"


def test_not_found_and_method_errors(stack):
    err = _error(_post(stack, "/v1/completions", {"model": "nope", "prompt": "hi"}), 404, "not_found_error", "model")
    assert err["code"] == "model_not_found"
    _error(_post(stack, "/v1/chat/completions", {**CHAT, "model": "nope"}), 404, "not_found_error", "model")
    _error(requests.get(f"{stack.url}/v1/nothing-here"), 404, "not_found_error")
    _error(requests.get(f"{stack.url}/v1/completions"), 405, "invalid_request_error")


def test_openai_sdk_maps_errors(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def _register(r, name: str, heartbeat_age: float | None, role: str = "unified") -> None:
    info = ModelInfo(name=name, path="/nonexistent", max_model_len=64, vocab_size=100, eos_token_ids=[0],
                     block_size=16, dtype="float32")
    r.set(keys.model_key(name), encode(info))
    r.sadd(keys.MODELS_INDEX, name)
    if heartbeat_age is not None:  # a worker whose key is still there but whose heartbeat is stale
        now = time.time()
        worker = WorkerInfo(worker_id=f"{name}-w", role=role, models=[name], zmq_addr="tcp://127.0.0.1:1",
                            free_blocks=1, total_blocks=1, running=0, waiting=0, pid=1, host="h", started=now,
                            heartbeat=now - heartbeat_age)
        r.set(keys.worker_key(worker.worker_id), encode(worker), ex=60)
        r.sadd(keys.WORKERS_INDEX, worker.worker_id)


def test_no_live_worker_is_503_with_retry_after(stack):
    r = sync_client(stack.redis_url)
    try:
        _register(r, "orphan", heartbeat_age=None)
        _register(r, "stale", heartbeat_age=keys.HEARTBEAT_TTL_S + 5)
        for name in ("orphan", "stale"):
            resp = _post(stack, "/v1/completions", {"model": name, "prompt": [1, 2]})
            err = _error(resp, 503, "service_unavailable_error")
            assert int(resp.headers["Retry-After"]) > 0 and name in err["message"]
        # Models whose workers are all gone (what an ended deployment leaves in Redis until their records
        # expire) do not take the served model's gateway out of rotation...
        ready = ready_after_tokenizers(stack.url)
        assert ready.status_code == 200 and set(ready.json()["models"]) == {MODEL}, ready.text
        assert ready.json()["models"][MODEL]["decode_workers"] == 1
        # ...but a model with one phase's worker alive and the other's gone is not ready
        _register(r, "half", heartbeat_age=0.0, role="prefill")
        ready = requests.get(f"{stack.url}/ready")
        assert ready.status_code == 503, ready.text
        assert ready.json()["models"]["half"] == {"prefill_workers": 1, "decode_workers": 0}
        # only what a request can be served by now
        assert {m["id"] for m in requests.get(f"{stack.url}/v1/models").json()["data"]} == {MODEL}
        # With several models registered, a request must name one.
        _error(_post(stack, "/v1/completions", {"prompt": "hi"}), 400, "invalid_request_error", "model")
    finally:
        for name in ("orphan", "stale", "half"):
            r.delete(keys.model_key(name), keys.worker_key(f"{name}-w"))
            r.srem(keys.MODELS_INDEX, name)
            r.srem(keys.WORKERS_INDEX, f"{name}-w")
        r.close()
    assert requests.get(f"{stack.url}/ready").status_code == 200


def test_worker_error_non_stream_and_stream(stack):
    err = _error(_post(stack, "/v1/completions", {"model": MODEL, "prompt": "[error] go"}), 500, "server_error")
    assert "fake worker exploded" in err["message"]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="fake worker exploded"):
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[error]"}],
                                            stream=True))
    raw = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "[error] go", "stream": True}).text
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and '"error"' in events[-3]


def test_a_dead_holder_announced_before_any_decode_token_fails_the_stream(stack):
    """The decode side names itself (an event with no tokens) before the prefill side drops the job; if it
    dies before its first token, the gateway must fail the stream within its poll, not hang, and the
    announcement itself must not reach the client as an empty chunk. A hang would end at the request
    timeout with a timeout_error; the error naming the stopped worker is the poll's."""
    raw = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "[orphan] go", "stream": True,
                                           "max_tokens": 5}).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and "stopped" in events[-2] and '"error"' in events[-2]
    assert "timeout_error" not in events[-2]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"][0]["text"] for c in chunks] and all(c["choices"][0]["text"] for c in chunks)


def test_malformed_token_batches_are_dropped(stack):
    """Garbage on the reply socket must not break the dispatcher for everyone else."""
    address = stack.server.app[DISPATCHER].address
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    zmq_auth.dial(push, CURVE)  # a worker of the deployment with a bug: its messages do arrive
    push.connect(address)
    for junk in (b"", b"\xc1garbage", encode(Abort(request_ids=["x"]))):
        push.send(junk)
    push.close(linger=1000)
    ctx.term()
    out = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert out.status_code == 200


async def _next_abort(pubsub, timeout: float = 60.0) -> Abort:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            return decode(msg["data"], Abort)
    raise AssertionError("no abort published")


async def test_client_disconnect_publishes_abort(stack):
    r = async_client(stack.redis_url)
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.ABORT_CHANNEL)
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{stack.url}/v1/completions",
                                      json={"model": MODEL, "prompt": "[slow] go", "stream": True, "max_tokens": 80})
            first = await resp.content.readline()
            assert first.startswith(b"data: ")
            job_id = json.loads(first[len(b"data: "):])["id"].removeprefix("cmpl-") + "-0"
            resp.close()  # drop the connection mid-stream
        abort = await _next_abort(pubsub)
        assert abort.request_ids == [job_id] and "disconnect" in abort.reason
        deadline = time.monotonic() + 30
        while job_id not in stack.worker.aborted and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert job_id in stack.worker.aborted
    finally:
        await pubsub.aclose()
        await r.aclose()


def _silent_jobs(stack) -> list[str]:
    return [j.request_id for j in list(stack.worker.jobs) if "[silent]" in stack.tokenizer.decode(j.prompt_token_ids)]


def test_request_timeout_is_a_clean_error(stack):
    """A job nobody answers ends at the deadline with a 504 (or an SSE error), never a hang, and is aborted.
    The client's own timeout only bounds a hang: the 504 is the gateway's, sent at its deadline."""
    server = GatewayServer(gateway_config(stack.redis_url, request_timeout=1.0)).start()
    try:
        resp = requests.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "[silent] go"}, timeout=60)
        err = _error(resp, 504, "timeout_error")
        assert "timed out after 1s" in err["message"]
        resp = requests.post(f"{server.url}/v1/chat/completions", timeout=60,
                             json={**CHAT, "messages": [{"role": "user", "content": "[silent]"}], "stream": True})
        events = resp.text.split("\n\n")
        assert resp.status_code == 200 and events[-2] == "data: [DONE]" and "timeout_error" in events[-3]
        # the worker's reader thread takes each job and its abort in its own time
        deadline = time.monotonic() + 30
        while not (len(silent := _silent_jobs(stack)) == 2 and set(silent) <= stack.worker.aborted) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(silent) == 2 and set(silent) <= stack.worker.aborted
    finally:
        server.stop()


def test_redis_down_is_503(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    server = GatewayServer(gateway_config(f"redis://127.0.0.1:{dead_port}/0")).start()
    try:
        # /health answers from the Redis watch's state, no round trip of its own: 503 naming the store
        err = _error(requests.get(f"{server.url}/health"), 503, "service_unavailable_error")
        assert err["code"] == "store_unavailable" and "Redis" in err["message"] and err["param"] is None
        assert requests.get(f"{server.url}/ready").status_code == 503
        _error(requests.get(f"{server.url}/v1/models"), 503, "service_unavailable_error")
    finally:
        server.stop()


def test_a_model_registered_after_the_cached_view_is_no_404(tmp_path):
    """The gateway reuses its Redis view of the models for registry_cache_s; a model registered inside
    that window (by a worker's --config, or the admin API of another gateway) must not be a 404."""
    with running_stack(tmp_path, registry_cache_s=300.0) as stack:
        r = sync_client(stack.redis_url)
        try:
            _error(_post(stack, "/v1/completions", {"model": "late", "prompt": [1, 2]}), 404, "not_found_error")
            _register(r, "late", heartbeat_age=None)  # the view cached by the 404 above lacks it
            resp = _post(stack, "/v1/completions", {"model": "late", "prompt": [1, 2]})
            assert "late" in _error(resp, 503, "service_unavailable_error")["message"]  # known, no worker yet
        finally:
            r.close()
