"""The gateway's happy paths through the official ``openai`` SDK (sync and async, stream and not), against
real Redis, real ZMQ and a fake worker (tests/integration/gateway_harness.py)."""

import json
import time

import openai
import pytest
import requests

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.priority_bands import BANDS, band_stream
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import MAX_MODEL_LEN, MODEL, REPLY, ready_after_tokenizers, running_stack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("gateway"), enable_prompt_tokens_details=True) as s:
        yield s


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(stack):
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def _id_prefix(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def test_models_lists_registered_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client, stack):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hello there", max_tokens=64,
                                                      extra_headers={"X-Request-Id": "client-id-42"})
    assert raw.headers["X-Request-Id"] == "client-id-42"
    out = raw.parse()
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.text == REPLY and choice.finish_reason == "stop"
    prompt_ids = stack.tokenizer.encode("hello there")
    reply_ids = stack.tokenizer.encode(REPLY)
    # EOS counts as a generated token but adds no text.
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(reply_ids) + 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // 2  # as the worker reported
    (job,) = stack.jobs_for(_id_prefix(out.id))
    assert job.request_id.endswith("-0") and job.prompt_token_ids == prompt_ids
    assert job.model == MODEL and job.sampling.n == 1 and job.sampling.max_tokens == 64
    assert job.deadline > job.arrival and job.reply_addr.startswith("tcp://127.0.0.1:")


def test_generated_request_id_header(stack):
    r = requests.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and len(r.headers["X-Request-Id"]) >= 16


def test_max_tokens_length_finish(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert REPLY.startswith(out.choices[0].text) and out.choices[0].text


def test_completion_stream_matches_non_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=64, stream=True))
    assert len(chunks) > 5  # streamed, not one lump
    assert "".join(c.choices[0].text for c in chunks) == REPLY
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_token_prompts_and_prompt_lists(client, stack):
    ids = stack.tokenizer.encode("hello")
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:1]], max_tokens=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == len(ids) + 1
    assert out.usage.prompt_tokens_details.cached_tokens == len(ids) // 2
    jobs = sorted(stack.jobs_for(_id_prefix(out.id)), key=lambda j: j.request_id)
    assert [j.prompt_token_ids for j in jobs] == [ids, ids[:1]]
    out = client.completions.create(model=MODEL, prompt=["hello", "hello there"], max_tokens=2, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


async def test_chat_async(aclient, stack):
    out = await aclient.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == REPLY
    (job,) = stack.jobs_for(_id_prefix(out.id))
    rendered = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert stack.tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False) == rendered
    # No max_tokens: whatever context the prompt leaves (vLLM's chat default).
    assert job.sampling.max_tokens == MAX_MODEL_LEN - len(job.prompt_token_ids)


async def test_chat_stream_async(aclient):
    stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   stream=True, max_completion_tokens=64)
    chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_include_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, max_tokens=4, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4
    assert all(c.usage is None for c in chunks[:-1])
    without = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
    assert all(c.choices for c in without)


def test_n_fans_out_into_seeded_jobs(client, stack):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=2, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.text == out.choices[0].text for c in out.choices)
    assert out.usage.completion_tokens == 10
    jobs = sorted(stack.jobs_for(_id_prefix(out.id)), key=lambda j: j.request_id)
    rid = _id_prefix(out.id)
    assert [j.request_id for j in jobs] == [f"{rid}-0", f"{rid}-1"]
    assert [j.sampling.seed for j in jobs] == [7, 8] and all(j.sampling.n == 1 for j in jobs)


def test_n_streams_interleave_by_index(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 stream=True, n=2, max_tokens=6))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"


def test_stop_string_split_across_tokens_never_leaks(client, stack):
    stop = "brown fox"  # spans " ", "b", "r", "ow", "n", " fox" in the tiny tokenizer
    assert len(stack.tokenizer.encode(" brown fox")) > 2
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=64, stop=[stop, "zzz"], stream=True)
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks]
    expected = REPLY[: REPLY.index(stop)]
    assert "".join(texts) == expected  # emitted text is never taken back, so a leak would show here
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The worker was still generating: the gateway aborts the job so its blocks are freed.
    job_id = f"{_id_prefix(chunks[0].id)}-0"
    deadline = time.time() + 5
    while job_id not in stack.worker.aborted and time.time() < deadline:
        time.sleep(0.02)
    assert job_id in stack.worker.aborted
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=64, stop=stop,
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == expected + stop
    assert out.choices[0].model_extra["stop_reason"] == stop


def test_stop_token_id_text_is_excluded(client, stack):
    fox = stack.tokenizer.encode(" fox")[0]
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=64, extra_body={"stop_token_ids": [fox]})
    assert out.choices[0].text == REPLY[: REPLY.index(" fox")]
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == fox


def test_min_tokens_defers_stop_strings(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=64, stop=["Hello"],
                                    extra_body={"min_tokens": 3})
    assert out.choices[0].text == REPLY


def test_completion_logprobs_shape(client, stack):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.token_logprobs == [-0.5] * 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) == 2 and top[tok] == -0.5 for top, tok in zip(lp.top_logprobs, lp.tokens, strict=True))
    streamed = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=0, stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed) == 5


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob == -0.5 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[2].logprob == -9999.0  # -inf from the worker, clamped for JSON
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].logprobs is None


def test_prompt_tokens_details_are_null_unless_enabled(tmp_path):
    """vLLM's default: clients written for vLLM read null; --enable-prompt-tokens-details gives OpenAI's
    {"cached_tokens": N} (the module's stack has it on)."""
    with running_stack(tmp_path) as plain:
        c = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="x", max_retries=0)
        out = c.completions.create(model=MODEL, prompt="hello there", max_tokens=2)
        assert out.usage.prompt_tokens_details is None and out.usage.prompt_tokens > 0
        r = requests.post(f"{plain.url}/v1/chat/completions", stream=True, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}})
        last = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]
        assert last["usage"]["prompt_tokens_details"] is None and last["usage"]["completion_tokens"] == 2


def test_prompt_logprobs_pass_through(client, stack):
    out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=1,
                                    extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    ids = stack.tokenizer.encode("hello there")
    assert entries[0] is None and len(entries) == len(ids)
    assert entries[1] == {str(ids[1]): {"logprob": -1.0, "rank": None, "decoded_token": stack.tokenizer.decode([ids[1]])}}


@pytest.mark.parametrize("mode", ["reverse", "dup"])
def test_out_of_order_and_duplicate_events(client, mode):
    out = client.completions.create(model=MODEL, prompt=f"[{mode}] go", max_tokens=64)
    assert out.choices[0].text == REPLY and out.choices[0].finish_reason == "stop"


def test_sse_framing(stack):
    r = requests.post(f"{stack.url}/v1/completions", stream=True,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    body = r.content.decode()
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)


def test_a_null_field_means_its_default(stack):
    """OpenAI's schema types most fields "X or null"; the openai SDK sends a None it is given as null."""
    r = requests.post(f"{stack.url}/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
        "stop": None, "seed": None, "logit_bias": None, "stream": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_an_unknown_field_is_a_400_naming_it(stack):
    """Accepted and ignored, a misspelt field would hand the client another answer than it asked for."""
    r = requests.post(f"{stack.url}/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": {}, "temprature": 0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "temprature" and "temprature" in r.json()["error"]["message"]
    r = requests.post(f"{stack.url}/v1/completions",  # a field kvrelay lacks, sent as "off": accepted
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "tools": []})
    assert r.status_code == 200, r.text


def test_a_priority_is_refused_where_the_workers_serve_first_come_first_served(stack):
    """The fake worker publishes --scheduling-policy fcfs, as a real worker does by default: its engine would
    ignore the field, so the gateway refuses it (vLLM's answer too), for completions and chat alike; 0 is the
    default and always passes. Where a worker publishes "priority" (test_tenants.py) the field reaches its job,
    queued in its band's stream (test_gateway_priority_bands.py)."""
    for path, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):
        r = requests.post(f"{stack.url}/v1/{path}", json={"model": MODEL, "max_tokens": 1, "priority": -2, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority" and "--scheduling-policy priority" in r.text
        r = requests.post(f"{stack.url}/v1/{path}", json={"model": MODEL, "max_tokens": 1, "priority": 0, **body})
        assert r.status_code == 200, r.text
    # its jobs went to the shared stream, as ever: no priority band stream exists for a first come, first served model
    redis = sync_client(stack.redis_url)
    assert not any(redis.exists(band_stream(MODEL, band)) for band in BANDS if band)
    redis.close()


def test_tokenize_detokenize(stack):
    r = requests.post(f"{stack.url}/tokenize", json={"model": MODEL, "prompt": "hello there"})
    body = r.json()
    assert body["tokens"] == stack.tokenizer.encode("hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    r = requests.post(f"{stack.url}/detokenize", json={"tokens": body["tokens"]})  # model optional: only one
    assert r.json() == {"prompt": "hello there"}
    r = requests.post(f"{stack.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    ids = r.json()["tokens"]
    assert stack.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_health_and_ready(stack):
    assert requests.get(f"{stack.url}/health").status_code == 200
    r = ready_after_tokenizers(stack.url)
    assert r.status_code == 200, r.text
    assert r.json()["models"][MODEL] == {"prefill_workers": 1, "decode_workers": 1}


def test_jobs_are_valid_protocol_messages(stack, client):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    r = sync_client(stack.redis_url)
    entries = r.xrevrange(keys.prefill_stream(MODEL), count=1)
    r.close()
    job = decode(entries[0][1][keys.JOB_FIELD.encode()], Job)
    assert job.tenant == "default" and job.priority == 0
