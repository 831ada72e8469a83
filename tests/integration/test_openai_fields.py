"""Request fields real clients send beyond sampling (issue #25): each takes effect or is a 400 naming it.

Against the real gateway, real Redis and ZMQ and the harness's fake worker (tests/integration/gateway_harness.py),
through the openai SDK where it can send the field and plain HTTP where a 400 must be read as sent.
"""

import json

import openai
import pytest
import requests

from tests.integration.gateway_harness import MODEL, REPLY, api_path, running_stack

pytestmark = pytest.mark.timeout(120)

PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("openai-fields")) as s:
        yield s


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def post(stack, body: dict) -> requests.Response:
    return requests.post(f"{stack.url}{api_path(body)}", json=body, timeout=30)


def assert_400(r: requests.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


def events(r: requests.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_an_empty_model_is_the_only_model(stack, body):
    r = post(stack, {**body, "model": ""})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_openai_fields_that_ask_for_nothing_are_accepted(client):
    # what the openai SDK sends for them; none can change the answer
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=64,
                                         store=False, metadata={"team": "search"}, service_tier="auto",
                                         prompt_cache_key="conversation-7", safety_identifier="user-hash",
                                         user="u1")
    assert out.choices[0].message.content == REPLY
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="u1",
                                    extra_body={"store": False, "service_tier": "auto", "metadata": {"a": "b"},
                                                "prompt_cache_key": "k", "safety_identifier": "s"})
    assert out.usage.completion_tokens == 2


@pytest.mark.parametrize("body", [PROMPT, CHAT])
@pytest.mark.parametrize("field, value, param, why", [
    ("store", True, "store", "keeps no completions"),
    ("service_tier", "flex", "service_tier", "only 'auto'"),
    ("service_tier", "priority", "service_tier", "only 'auto'"),
    ("metadata", {"a": 1}, "metadata.a", "string"),
    ("metadata", "x", "metadata", ""),
    ("prompt_cache_key", 5, "prompt_cache_key", "string"),
])
def test_openai_fields_that_ask_for_something_are_400s(stack, body, field, value, param, why):
    assert why in assert_400(post(stack, {**body, field: value}), param)


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_unknown_stream_options_are_400s(stack, body):
    r = post(stack, {**body, "stream": True, "stream_options": {"include_usage": True, "include_usages": True}})
    assert "include_usages" in assert_400(r, "stream_options.include_usages")


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_continuous_usage_stats_without_include_usage_adds_no_usage(stack, body):
    """As vLLM: the pair is accepted, and without include_usage no chunk carries a usage."""
    r = post(stack, {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    assert all("usage" not in e for e in events(r))


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(stack, body):
    stream = {**body, "stream": True, "max_tokens": 4}
    plain = events(post(stack, {**stream, "stream_options": {"include_usage": True}}))
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 4
    chunks = events(post(stack, {**stream, "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}}))
    with_text = [e for e in chunks if e["choices"]]
    assert all(e["usage"] is not None for e in chunks)
    counts = [e["usage"]["completion_tokens"] for e in with_text]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] < 4
    assert all(e["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0 for e in chunks)
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 4


def test_return_tokens_as_token_ids(stack, client):
    body = {**PROMPT, "logprobs": 2}
    as_text = post(stack, body).json()["choices"][0]["logprobs"]
    as_ids = post(stack, {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    want = stack.tokenizer.encode(REPLY)[:4]
    assert as_ids["tokens"] == [f"token_id:{t}" for t in want]
    assert as_text["tokens"] == [stack.tokenizer.decode([t]) for t in want]
    assert as_ids["token_logprobs"] == as_text["token_logprobs"]
    assert all(k.startswith("token_id:") for top in as_ids["top_logprobs"] for k in top)
    streamed = [t for e in events(post(stack, {**body, "stream": True, "return_tokens_as_token_ids": True}))
                if e["choices"] and e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == as_ids["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in want[:2]]
    assert content[0].bytes == list(content[0].token.encode())
    assert content[0].top_logprobs[0].token.startswith("token_id:")


def _prompt_text(stack, response_id: str) -> str:
    (job,) = stack.jobs_for(response_id.split("-", 1)[1])
    return stack.tokenizer.decode(job.prompt_token_ids)


def test_continue_final_message_leaves_the_final_message_open(stack):
    history = [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "The quick brown"}]
    body = {**CHAT, "messages": history, "add_generation_prompt": False}
    closed = post(stack, body)
    assert _prompt_text(stack, closed.json()["id"]).endswith("The quick brown<|im_end|>\n")
    opened = post(stack, {**body, "continue_final_message": True})
    assert opened.status_code == 200, opened.text
    assert _prompt_text(stack, opened.json()["id"]).endswith("<|im_start|>assistant\nThe quick brown")
    # both would open a new message and continue it: refused, as vLLM does
    r = post(stack, {**CHAT, "messages": history, "continue_final_message": True})
    assert "add_generation_prompt" in assert_400(r, "continue_final_message")
    r = post(stack, {**body, "chat_template_kwargs": {"continue_final_message": True}})
    assert_400(r, "chat_template_kwargs")


def test_echo_puts_the_prompt_before_the_text(stack):
    out = post(stack, {**PROMPT, "prompt": ["hello there", "the lazy dog"], "echo": True, "n": 2}).json()
    assert sorted(c["text"] for c in out["choices"]) == sorted(
        [p + stack.tokenizer.decode(stack.tokenizer.encode(REPLY)[:4]) for p in ("hello there", "the lazy dog")] * 2)
    ids = stack.tokenizer.encode("hello there")
    by_ids = post(stack, {**PROMPT, "prompt": ids, "echo": True}).json()["choices"][0]["text"]
    assert by_ids.startswith("hello there")
    # streamed: each choice opens with its prompt
    chunks = events(post(stack, {**PROMPT, "echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["text"] == "hi"
    assert "".join(e["choices"][0]["text"] for e in chunks) == "hi" + stack.tokenizer.decode(
        stack.tokenizer.encode(REPLY)[:4])


def test_echo_with_logprobs_covers_the_prompt_tokens(stack):
    ids = stack.tokenizer.encode("hello there")
    choice = post(stack, {**PROMPT, "prompt": "hello there", "echo": True, "logprobs": 1}).json()["choices"][0]
    lp = choice["logprobs"]
    out_ids = stack.tokenizer.encode(REPLY)[:4]
    assert lp["tokens"] == [stack.tokenizer.decode([t]) for t in ids + out_ids]
    # the harness's worker gives every prompt token -1.0 and every output token -0.5
    assert lp["token_logprobs"] == [None] + [-1.0] * (len(ids) - 1) + [-0.5] * 4
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {stack.tokenizer.decode([ids[1]]): -1.0}
    assert lp["text_offset"][len(ids)] == len("hello there")  # the first output token starts after the prompt
    assert choice["text"][lp["text_offset"][-1]:] == lp["tokens"][-1]
    assert choice["prompt_logprobs"] is None  # not asked for


def test_echo_with_logprobs_streamed_says_what_the_whole_reply_says(stack):
    """The prompt, its logprobs in front, arrive in each choice's first chunk (with its first text, as vLLM
    sends them); joined, the chunks are the unstreamed reply, offsets included."""
    body = {**PROMPT, "prompt": ["hello there", "the lazy dog"], "echo": True, "logprobs": 1, "n": 2}
    whole = {c["index"]: c for c in post(stack, body).json()["choices"]}
    joined: dict[int, dict] = {}
    for event in events(post(stack, {**body, "stream": True})):
        for c in event["choices"]:
            seen = joined.setdefault(c["index"], {"text": "", "logprobs": {}, "chunks": 0})
            if seen["chunks"] == 0:
                prompt = "hello there" if c["index"] < 2 else "the lazy dog"  # n=2 choices per prompt
                assert c["text"].startswith(prompt) and c["logprobs"]["token_logprobs"][0] is None
            seen["chunks"] += 1
            seen["text"] += c["text"]
            for key, values in (c["logprobs"] or {}).items():
                seen["logprobs"].setdefault(key, []).extend(values)
    assert len(joined) == 4
    for index, c in joined.items():
        assert c["chunks"] > 1 and c["text"] == whole[index]["text"]
        assert c["logprobs"] == whole[index]["logprobs"]


@pytest.mark.parametrize("body, field", [
    ({**PROMPT, "logprobs": -1}, "logprobs"),
    ({**PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({**PROMPT, "echo": True, "logprobs": -1}, "logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({**CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_the_whole_vocabulary_is_past_the_default_max_logprobs(stack, body, field):
    message = assert_400(post(stack, body), field)
    assert "--max-logprobs" in message and "at most 20" in message


def test_max_logprobs_bounds_and_unbounds(tmp_path):
    with running_stack(tmp_path / "two", max_logprobs=2) as two:
        assert "at most 2 " in assert_400(post(two, {**PROMPT, "logprobs": 3}), "logprobs")
        assert post(two, {**PROMPT, "logprobs": 2}).status_code == 200
    with running_stack(tmp_path / "all", max_logprobs=-1) as unbounded:
        r = post(unbounded, {**PROMPT, "logprobs": -1, "prompt_logprobs": -1})
        assert r.status_code == 200, r.text
        # the harness's worker knows three alternatives; every one it sent is shown, none cut off
        assert all(len(top) == 3 for top in r.json()["choices"][0]["logprobs"]["top_logprobs"])


CONTINUED = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
             "continue_final_message": True, "add_generation_prompt": False}


def test_chat_echo_opens_the_reply_with_the_final_assistant_message(stack):
    """vLLM's chat echo: whole and streamed, the content starts with the message the reply continues."""
    plain = post(stack, CONTINUED).json()["choices"][0]["message"]["content"]
    echoed = post(stack, {**CONTINUED, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    chunks = events(post(stack, {**CONTINUED, "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed


def test_chat_echo_needs_a_final_assistant_message(stack):
    assert "final message" in assert_400(post(stack, {**CHAT, "echo": True}), "echo")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/invocations"])
def test_a_body_declared_as_not_json_is_a_415(stack, path):
    """As vLLM answers a form-encoded body (curl -d without a JSON Content-Type); no Content-Type reads as JSON."""
    body = json.dumps(PROMPT if "chat" not in path else CHAT)
    r = requests.post(f"{stack.url}{path}", data=body, timeout=30,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert requests.post(f"{stack.url}{path}", data=body.encode(), timeout=30).status_code == 200
