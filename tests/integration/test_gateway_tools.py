"""Tool calling through the gateway with the ``openai`` SDK: real Redis, ZMQ and gateway, and the fake
worker of tests/integration/gateway_harness.py, whose ``[tool]`` reply is text plus two hermes calls. This is
the fast layer for parsing and streaming a reply whose text is known; tests/e2e/test_tool_calling.py runs
a real model. Two stacks: one whose chat template renders tools, served with --enable-auto-tool-choice
--tool-call-parser hermes, and one with neither."""

import json

import openai
import pytest

from tests.integration.gateway_harness import MODEL, TOOL_REPLY, running_stack

pytestmark = pytest.mark.timeout(120)

# Renders tools, assistant calls (arguments as objects, as real templates do) and tool results.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather? [tool]"}]
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("tools"), chat_template=TOOLS_TEMPLATE, max_model_len=2048,
                       enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("plain"), max_model_len=2048) as s:
        yield s


def client_of(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def prompt_of(stack, response_id: str) -> str:
    (job,) = [j for j in stack.worker.jobs if j.request_id.startswith(response_id.split("-", 1)[1])]
    return stack.tokenizer.decode(job.prompt_token_ids)


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


def test_auto_parses_the_calls_out_of_the_reply(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=500)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    prompt = prompt_of(stack, out.id)
    assert prompt.startswith('<|im_start|>system\nTools: [{"type": "function"') and '"get_weather"' in prompt


def test_streamed_calls_arrive_as_deltas_and_no_markup_as_content(stack):
    stream = client_of(stack).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=500,
                                                      stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        delta = choice.delta
        assert "<tool_call>" not in (delta.content or "")
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:  # the first delta of a call: index, id, type, name
                assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                calls[tc.index][1] += tc.function.arguments
        finish = choice.finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls.values()] == CALLS


def test_parallel_tool_calls_false_keeps_the_first_call(stack):
    client = client_of(stack)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=500,
                                         parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=500,
                                            parallel_tool_calls=False, stream=True)
    indices = {tc.index for chunk in stream for tc in chunk.choices[0].delta.tool_calls or []}
    assert indices == {0}


def test_tool_choice_none_offers_no_tools_and_parses_nothing(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                   max_tokens=500)
    (choice,) = out.choices
    assert choice.message.content == TOOL_REPLY and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "Tools:" not in prompt_of(stack, out.id)


def test_a_reply_cut_short_stays_length(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5)
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


def test_history_with_calls_and_results_renders(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER], max_tokens=500)
    assert out.choices[0].message.content  # the fake worker's usual reply: no calls in it
    prompt = prompt_of(stack, out.id)
    # the call's arguments reach the template as an object: encoded once, not as a JSON string in JSON
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>" in prompt


@pytest.mark.parametrize("change, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather", "strict": True}}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "paramaters": {}}}]}, "tools.0.function.paramaters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools.0.function.strict"),
    ({"messages": [HISTORY[0], {**HISTORY[1], "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [HISTORY[0], {**HISTORY[1], "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                      "arguments": "{}"}}]}]},
     "messages.1.tool_calls.0.type"),
    ({"messages": [*HISTORY[:2], {"role": "tool", "content": "sunny"}]}, "messages.2.tool_call_id"),
    ({"messages": [HISTORY[0], {"role": "assistant", "content": None}]}, "messages.1.content"),
])
def test_bad_tool_requests_name_the_field(stack, change, param):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 5, **change}
    error = bad_request(lambda: client_of(stack).chat.completions.create(**body))
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_empty_tool_parts_ask_for_nothing(plain_stack):
    """Some clients send tool_calls and tool_call_id as null or [] on every message."""
    messages = [{"role": "user", "content": "hi", "tool_call_id": None},
                {"role": "assistant", "content": "hello", "tool_calls": []}, {**ASK[0], "tool_calls": None}]
    out = client_of(plain_stack).chat.completions.create(model=MODEL, messages=messages, max_tokens=500)
    assert out.choices[0].message.content == TOOL_REPLY


def test_auto_needs_the_server_flags(plain_stack):
    client = client_of(plain_stack)
    error = bad_request(lambda: client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]))
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
    # tools: [] asks for nothing, and "none" offers nothing: both served as before
    for extra in ({"tools": []}, {"tools": [WEATHER], "tool_choice": "none"}):
        out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=500, **extra)
        assert out.choices[0].message.content == TOOL_REPLY and not out.choices[0].message.tool_calls


def test_a_template_without_tools_is_a_clear_400_not_a_template_error(plain_stack):
    """The harness's default template renders neither tools nor calls (content null reads "None")."""
    client = client_of(plain_stack)
    for messages, param in ((HISTORY, "messages.1.tool_calls"), (HISTORY[:1] + HISTORY[2:], "messages.1.role")):
        error = bad_request(lambda m=messages: client.chat.completions.create(model=MODEL, messages=m))
        assert error["param"] == param and "does not render tools" in error["message"], error
        assert "dict object" not in error["message"]
