"""What the request-field tests share (tests/e2e/test_request_fields.py and its neighbours, on the SmolLM2
that tests/e2e/conftest.py's ``fields_http`` serves): the engine's flags, the base bodies and token ids they
vary, how a test reads an answer, and how it posts one."""

import json
from typing import Any

import httpx

MODEL = "smollm2"
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "4", "--served-model-name", MODEL,
          "--num-gpu-blocks-override", "2048"]
PARIS = 7042  # " Paris" in SmolLM2's vocabulary (the fixture checks it through /tokenize)
EOS = 2  # <|im_end|>, SmolLM2's end of sequence (the fixture checks it too)
VOCAB = 49152
BASE = {
    "completions": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
             "max_tokens": 6, "temperature": 0},
}
SAMPLED = {"temperature": 1.5, "seed": 1}  # a baseline that samples: filters and seeds change it
EOS_FIRST = {"logit_bias": {str(EOS): 100}, "max_tokens": 3}  # a baseline that ends at its first token
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


def choice_text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def text(r: httpx.Response) -> str:
    return choice_text(r.json()["choices"][0])


def sse_events(r: httpx.Response) -> list[dict]:
    """A streamed answer's data events, [DONE] left out."""
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def tokens(r: httpx.Response) -> int:
    return r.json()["usage"]["completion_tokens"]


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def logprobs(r: httpx.Response) -> Any:
    return r.json()["choices"][0]["logprobs"]


def prompt_logprobs(r: httpx.Response) -> Any:
    body = r.json()
    return body.get("prompt_logprobs", body["choices"][0].get("prompt_logprobs"))


def usage_chunks(r: httpx.Response) -> int:
    return sum(1 for e in sse_events(r) if e.get("usage"))


def choices(r: httpx.Response) -> int:
    return len(r.json()["choices"])


def content_type(r: httpx.Response) -> str:
    return r.headers["Content-Type"].split(";")[0]


def usage_chunk(r: httpx.Response) -> bool:
    return any(e.get("usage") for e in sse_events(r))


def post(client: httpx.Client, body: dict) -> httpx.Response:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    return client.post(path, json=body)


def ok(client: httpx.Client, body: dict) -> httpx.Response:
    r = post(client, body)
    assert r.status_code == 200, r.text
    return r
