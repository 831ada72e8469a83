"""``tool_choice: "required"`` and a named function through the gateway with the ``openai`` SDK: the job's
output schema (what the engine will enforce), and the reply read from output of that shape, whole and
streamed. The fake worker of tests/integration/gateway_harness.py answers ``[calls]`` with two calls as a
required choice's array and ``[args]`` with a named choice's arguments; tests/e2e/test_structured_outputs.py
runs a real model under the grammar."""

import json

import openai
import pytest

from tests.integration.gateway_harness import ARGS_REPLY, CALLS_REPLY, MODEL, running_stack
from tests.integration.test_gateway_tools import TOOLS_TEMPLATE, WEATHER, bad_request, client_of, prompt_of

pytestmark = pytest.mark.timeout(120)

TIME = {"type": "function", "function": {"name": "get_time", "description": "the time now"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
REQUIRED_ASK = [{"role": "user", "content": "weather? [calls]"}]
NAMED_ASK = [{"role": "user", "content": "weather? [args]"}]
NO_PARAMETERS = {"type": "object", "properties": {}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # no --enable-auto-tool-choice and no parser: forced calls need neither
    with running_stack(tmp_path_factory.mktemp("forced"), chat_template=TOOLS_TEMPLATE, max_model_len=2048) as s:
        yield s


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("forced-plain"), max_model_len=2048) as s:
        yield s


def schema_of(stack, response_id: str) -> dict:
    (job,) = [j for j in stack.worker.jobs if j.request_id.startswith(response_id.split("-", 1)[1])]
    outputs = job.sampling.structured_outputs
    assert outputs is not None and outputs.kind == "json"
    assert outputs.json == json.dumps(json.loads(outputs.json), sort_keys=True, separators=(",", ":"))
    return json.loads(outputs.json)


def branch(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": fn.get("parameters", NO_PARAMETERS)}}


def streamed(stream) -> tuple[str, dict[int, list], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function" and tc.id.startswith("call_")
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][1] += tc.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_constrains_to_an_array_of_the_tools_calls(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required", max_tokens=500)
    assert schema_of(stack, out.id) == {"type": "array", "minItems": 1,
                                        "items": {"anyOf": [branch(WEATHER), branch(TIME)]}}
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [(c["name"], c["parameters"]) for c in json.loads(CALLS_REPLY)]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert "Tools: [" in prompt_of(stack, out.id)  # a template that renders tools is offered them


def test_required_with_parallel_tool_calls_false_allows_one_call(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=500)
    assert schema_of(stack, out.id)["maxItems"] == 1


def test_required_streams_each_call_as_deltas(stack):
    stream = client_of(stack).chat.completions.create(model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME],
                                                      tool_choice="required", max_tokens=500, stream=True)
    content, calls, finish = streamed(stream)
    assert content == "" and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls.values()] == \
        [(c["name"], c["parameters"]) for c in json.loads(CALLS_REPLY)]


def test_named_constrains_to_the_functions_arguments(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[WEATHER, TIME],
                                                   tool_choice=NAMED, max_tokens=500)
    assert schema_of(stack, out.id) == WEATHER["function"]["parameters"]
    (choice,) = out.choices
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's for a named choice
    assert call.function.name == "get_weather" and call.function.arguments == ARGS_REPLY
    out = client_of(stack).chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[WEATHER, TIME],
                                                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                   max_tokens=500)
    assert schema_of(stack, out.id) == NO_PARAMETERS
    # parameters without "type" are an object's (as tool_schemas reads them), never any JSON value
    untyped = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "string"}}}}}
    out = client_of(stack).chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[untyped], max_tokens=500,
                                                   tool_choice={"type": "function", "function": {"name": "f"}})
    assert schema_of(stack, out.id) == {"type": "object", "properties": {"a": {"type": "string"}}}


def test_named_streams_its_arguments_as_they_come(stack):
    stream = client_of(stack).chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[WEATHER],
                                                      tool_choice=NAMED, max_tokens=500, stream=True)
    content, calls, finish = streamed(stream)
    assert content == "" and finish == "stop" and calls == {0: ["get_weather", ARGS_REPLY]}


def test_output_cut_short_keeps_length_and_its_text(stack):
    client = client_of(stack)
    out = client.chat.completions.create(model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=4)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls and choice.message.content
    assert CALLS_REPLY.startswith(choice.message.content)
    content, calls, finish = streamed(client.chat.completions.create(
        model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=4, stream=True))
    assert (content, calls, finish) == (choice.message.content, {}, "length")


def test_n_choices_each_get_their_calls(stack):
    out = client_of(stack).chat.completions.create(model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required", max_tokens=500, n=2)
    assert [len(c.message.tool_calls) for c in out.choices] == [2, 2]


def test_strict_needs_a_forced_choice(stack):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    client = client_of(stack)
    for choice in ("required", NAMED):
        ask = REQUIRED_ASK if choice == "required" else NAMED_ASK
        out = client.chat.completions.create(model=MODEL, messages=ask, tools=[strict], tool_choice=choice,
                                             max_tokens=500)
        assert out.choices[0].message.tool_calls
    error = bad_request(lambda: client.chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[strict],
                                                               tool_choice="auto", max_tokens=5))
    assert error["param"] == "tools.0.function.strict" and "required" in error["message"], error
    # "none" makes no call for strict to constrain
    out = client.chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[strict], tool_choice="none",
                                         max_tokens=500)
    assert out.choices[0].message.content == ARGS_REPLY


def test_a_template_without_tools_still_forces_the_call(plain_stack):
    """The schema carries the tools' names and arguments, so the call is made whether or not the template
    shows them to the model."""
    out = client_of(plain_stack).chat.completions.create(model=MODEL, messages=NAMED_ASK, tools=[WEATHER],
                                                         tool_choice=NAMED, max_tokens=500)
    assert out.choices[0].message.tool_calls[0].function.arguments == ARGS_REPLY
    assert schema_of(plain_stack, out.id) == WEATHER["function"]["parameters"]


def test_a_forced_call_with_another_constraint_is_a_400(stack):
    error = bad_request(lambda: client_of(stack).chat.completions.create(
        model=MODEL, messages=NAMED_ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=5,
        extra_body={"guided_regex": "a+"}))
    assert error["param"] == "tool_choice" and "guided_regex, tool_choice" in error["message"], error


def test_sdk_types_read_the_reply(stack):
    """The SDK's own parse of the reply: tool_calls typed, arguments a string."""
    out = client_of(stack).chat.completions.create(model=MODEL, messages=REQUIRED_ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required", max_tokens=500)
    assert isinstance(out.choices[0].message.tool_calls[0].function.arguments, str)
    assert isinstance(out, openai.types.chat.ChatCompletion)
