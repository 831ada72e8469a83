"""Hostile and broken requests against a real gateway with real workers: each gets its status and an
OpenAI error body (``{"error": {"message", "type", "param", "code"}}``), and afterwards the workers
still serve a greedy request correctly. The tiny model has SmolLM2's 49,152-token vocabulary and a
256-token context."""

import json

import httpx
import pytest

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow
OK = [5, 6, 7]  # a prompt of in-vocabulary token ids
USER = [{"role": "user", "content": "hi"}]


def completion(**kw) -> dict:
    return {"model": "tiny", "prompt": OK, "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **kw}


# (id, path, body: dict -> JSON or bytes -> sent raw, status, error code or None, error param or None)
CASES = [
    ("malformed-json", "completions", b'{"model": "tiny", prompt: [1]}', 400, None, None),
    ("truncated-json", "completions", b'{"model": "tiny", "prompt": [5, 6', 400, None, None),
    ("empty-body", "completions", b"", 400, None, None),
    ("body-is-array", "completions", b"[1, 2, 3]", 400, None, None),
    ("body-is-string", "chat/completions", b'"hello"', 400, None, None),
    ("nan-literal", "completions", b'{"model": "tiny", "prompt": [5], "temperature": NaN}', 400, None, "temperature"),
    ("deeply-nested", "completions", b"[" * 50_000 + b"]" * 50_000, 400, None, None),
    ("huge-int-literal", "completions", b'{"model": "tiny", "prompt": [5], "max_tokens": ' + b"9" * 5000 + b"}",
     400, None, None),
    ("invalid-utf8", "completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, None),
    ("lone-surrogate", "completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, None, None),
    ("prompt-wrong-type", "completions", completion(prompt=5), 400, None, "prompt"),
    ("prompt-mixed-types", "completions", completion(prompt=[1, "a"]), 400, None, "prompt"),
    ("model-wrong-type", "completions", completion(model=5), 400, None, "model"),
    ("max-tokens-string", "completions", completion(max_tokens="ten"), 400, None, "max_tokens"),
    ("max-tokens-bool", "completions", completion(max_tokens=True), 400, None, "max_tokens"),
    ("max-tokens-fraction", "completions", completion(max_tokens=3.5), 400, None, "max_tokens"),
    ("temperature-string", "completions", completion(temperature="hot"), 400, None, "temperature"),
    ("temperature-negative", "completions", completion(temperature=-1), 400, None, "temperature"),
    ("top-p-over-one", "completions", completion(top_p=1.5), 400, None, "top_p"),
    ("penalty-out-of-range", "completions", completion(presence_penalty=5), 400, None, "presence_penalty"),
    ("huge-n", "completions", completion(n=100_000), 400, None, "n"),
    ("zero-n", "completions", completion(n=0), 400, None, "n"),
    ("huge-max-tokens", "completions", completion(max_tokens=10**12), 400, "context_length_exceeded", "max_tokens"),
    ("zero-max-tokens", "completions", completion(max_tokens=0), 400, None, "max_tokens"),
    ("negative-token-id", "completions", completion(prompt=[5, -1]), 400, None, "prompt"),
    ("out-of-vocab-token-id", "completions", completion(prompt=[5, 99_999]), 400, None, "prompt"),
    ("empty-prompt-string", "completions", completion(prompt=""), 400, None, "prompt"),
    ("empty-prompt-list", "completions", completion(prompt=[]), 400, None, "prompt"),
    ("empty-prompt-in-batch", "completions", completion(prompt=[[5, 6], []]), 400, None, "prompt"),
    ("prompt-past-context", "completions", completion(prompt=list(range(5, 305))), 400,
     "context_length_exceeded", "prompt"),
    ("prompt-plus-max-tokens-past-context", "completions", completion(prompt=list(range(5, 205)), max_tokens=100),
     400, "context_length_exceeded", "max_tokens"),
    ("min-tokens-over-max", "completions", completion(min_tokens=10, max_tokens=5), 400, None, "min_tokens"),
    ("logprobs-too-many", "completions", completion(logprobs=100), 400, None, "logprobs"),
    ("logprobs-negative", "completions", completion(logprobs=-1), 400, None, "logprobs"),
    ("prompt-logprobs-too-many", "completions", completion(prompt_logprobs=10_000), 400, None, "prompt_logprobs"),
    ("too-many-stop-strings", "completions", completion(stop=[f"s{i}" for i in range(100)]), 400, None, "stop"),
    ("stop-string-too-long", "completions", completion(stop=["x" * 5000]), 400, None, "stop"),
    ("stop-token-out-of-vocab", "completions", completion(stop_token_ids=[99_999]), 400, None, "stop_token_ids"),
    ("string-prompt-past-context", "completions", completion(prompt="word " * 400), 400, "context_length_exceeded",
     "prompt"),
    ("seed-past-int64", "completions", completion(seed=2**80), 400, None, "seed"),
    ("stream-options-without-stream", "completions", completion(stream_options={"include_usage": True}),
     400, None, "stream_options"),
    ("unknown-model", "completions", completion(model="no-such-model"), 404, "model_not_found", "model"),
    ("empty-messages", "chat/completions", chat(messages=[]), 400, None, "messages"),
    ("messages-not-a-list", "chat/completions", chat(messages="hi"), 400, None, "messages"),
    ("empty-role", "chat/completions", chat(messages=[{"role": "", "content": "hi"}]), 400, None, "messages.0.role"),
    ("missing-role", "chat/completions", chat(messages=[{"content": "hi"}]), 400, None, "messages.0.role"),
    ("content-wrong-type", "chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400, None,
     "messages.0.content"),
    ("image-content-part", "chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, None, "messages.0.content.0.type"),
    ("top-logprobs-without-logprobs", "chat/completions", chat(top_logprobs=3), 400, None, "top_logprobs"),
    ("top-logprobs-too-many", "chat/completions", chat(logprobs=True, top_logprobs=30), 400, None, "top_logprobs"),
    ("chat-past-context", "chat/completions", chat(messages=[{"role": "user", "content": "word " * 400}]), 400,
     "context_length_exceeded", "messages"),
    ("negative-max-completion-tokens", "chat/completions", chat(max_completion_tokens=-1), 400, None, "max_tokens"),
    # strict types: no coercion, and what no client means on purpose
    ("model-null", "completions", completion(model=None), 400, None, "model"),
    ("stream-string", "completions", completion(stream="yes"), 400, None, "stream"),
    ("n-string", "completions", completion(n="2"), 400, None, "n"),
    ("max-tokens-numeric-string", "completions", completion(max_tokens="5"), 400, None, "max_tokens"),
    ("temperature-numeric-string", "completions", completion(temperature="0.5"), 400, None, "temperature"),
    ("logprobs-int-for-bool", "chat/completions", chat(logprobs=1), 400, None, "logprobs"),
    ("temperature-absurd", "completions", completion(temperature=1e308), 400, None, "temperature"),
    ("top-p-absurd", "completions", completion(top_p=1e308), 400, None, "top_p"),
    ("repetition-penalty-absurd", "completions", completion(repetition_penalty=1e308), 400, None,
     "repetition_penalty"),
    ("temperature-overflow-literal", "completions", b'{"model": "tiny", "prompt": [5], "temperature": 1e400}', 400,
     None, "temperature"),
    ("infinity-literal", "chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, None, "top_p"),
]


@pytest.fixture(scope="module")
def gateway_url(tiny_model_dir, tmp_path_factory):
    with EmbeddedRedis() as redis_url:
        with Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE,
                     tmp_path_factory.mktemp("bad-input")).disaggregated() as c:
            yield f"http://127.0.0.1:{c.port}"


def check_error_body(resp: httpx.Response) -> dict:
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == ("not_found_error" if resp.status_code == 404 else "invalid_request_error"), error
    return error


def test_every_bad_input_gets_its_status_and_an_openai_error(gateway_url):
    assert len(CASES) >= 30
    failures = []
    with httpx.Client(base_url=gateway_url, timeout=30) as http:
        for name, path, body, status, code, param in CASES:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            resp = http.post(f"/v1/{path}", content=raw, headers={"content-type": "application/json"})
            if resp.status_code != status:
                failures.append(f"{name}: {resp.status_code} != {status}: {resp.text[:200]}")
                continue
            error = check_error_body(resp)
            if code is not None and error["code"] != code or param is not None and error["param"] != param:
                failures.append(f"{name}: code/param {error['code']}/{error['param']} != {code}/{param}")
    assert not failures, "\n".join(failures)


def test_oversized_requests_and_odd_methods(gateway_url):
    with httpx.Client(base_url=gateway_url, timeout=30) as http:
        big = http.post("/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
        assert big.status_code == 413 and check_error_body(big)["code"] == "request_too_large"
        wrong_method = http.get("/v1/completions")
        assert wrong_method.status_code == 405 and check_error_body(wrong_method)["code"] == "method_not_allowed"
        unknown = http.post("/v1/nope", json={})
        assert unknown.status_code == 404 and check_error_body(unknown)
        # Headers past aiohttp's 8 KiB field limit are refused by its HTTP parser, before any handler
        # runs, so this one 400 is plain text; behind nginx, deploy/nginx/nginx.conf answers in JSON.
        huge_header = http.post("/v1/completions", json=completion(), headers={"x-padding": "a" * 20_000})
        assert huge_header.status_code in (400, 431)
        # An unknown field is a 400 naming it, as OpenAI answers: accepted and ignored, a misspelt one
        # would change the answer silently. A null logit_bias is "none".
        extra = http.post("/v1/completions", json=completion(temperature=0.0, foo={"bar": 1}, logit_bias=None))
        assert extra.status_code == 400 and check_error_body(extra) and extra.json()["error"]["param"] == "foo"
        plain = http.post("/v1/completions", json=completion(temperature=0.0, logit_bias=None))
        assert plain.status_code == 200, plain.text


def test_workers_still_serve_correctly_after_the_abuse(gateway_url):
    with httpx.Client(base_url=gateway_url, timeout=60) as http:
        first = http.post("/v1/completions", json=completion(max_tokens=8, temperature=0.0, ignore_eos=True))
        again = http.post("/v1/completions", json=completion(max_tokens=8, temperature=0.0, ignore_eos=True))
        ready = http.get("/ready")
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 8
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]  # greedy: deterministic
    assert ready.status_code == 200
