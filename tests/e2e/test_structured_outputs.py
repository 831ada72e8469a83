"""Structured outputs and forced tool calls on a real model: ``kvrelay serve`` of SmolLM2 (unified worker,
the engine's grammar backend) through the openai SDK, as issue 25's done-when asks:
  - ``client.beta.chat.completions.parse(response_format=<a Pydantic model>)`` returns a parsed object;
  - a json_schema request sampled at temperature 1 validates against its schema in 200 of 200 samples;
  - ``tool_choice="required"`` and a named function always give parseable calls, streamed and not;
  - the other constraints (choice, regex, grammar, json_object) hold on both endpoints;
  - a json_schema request and a forced call hold in the disaggregated mode too, across the handoff;
  - a constraint that spells a UTF-16 surrogate is a 400 naming its field.
The gateway's mapping of every field is tested fast in tests/integration/test_gateway_structured_outputs.py
and test_gateway_forced_calls.py."""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2"
ENGINE = ["--mode", "unified", "--dtype", "float32", "--max-model-len", "512", "--block-size", "8",
          "--served-model-name", MODEL, "--num-gpu-blocks-override", "4096"]
# Enums, booleans and a bounded pattern: every sample can finish well within max_tokens at temperature 1
WEATHER_REPORT = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]},
        "sunny": {"type": "boolean"},
        "rating": {"enum": [1, 2, 3, 4, 5]},
        "wind": {"enum": ["none", "light", "strong"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    },
    "required": ["city", "sunny", "rating", "wind", "code"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


class Person(BaseModel):
    name: Literal["Ada", "Alan", "Grace"]
    age: int
    likes_tea: bool


@pytest.fixture(scope="module")
def client(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-e2e") / "serve.log"
    with Served(["--model", str(smollm2_dir), *ENGINE], log, timeout=300) as served:
        # 200 samples of up to 160 tokens in one call take minutes on a busy 2-core box: a liveness bound
        yield served.client(timeout=600)


def test_parse_with_a_pydantic_model_returns_the_object(client):
    out = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                             response_format=Person, max_tokens=120, temperature=0)
    (choice,) = out.choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person), choice.message


def test_json_schema_at_temperature_one_validates_in_every_sample(client):
    """200 samples: 4 requests of n=50, all in flight at once (the engine batches them)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather_report", "schema": WEATHER_REPORT, "strict": True}}

    def sample(seed: int) -> list[openai.types.chat.chat_completion.Choice]:
        return client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, n=50, temperature=1.0,
                                              seed=seed * 50, max_tokens=160).choices

    with ThreadPoolExecutor(4) as pool:
        choices = [c for batch in pool.map(sample, range(4)) for c in batch]
    assert len(choices) == 200
    bad = []
    for c in choices:
        try:
            jsonschema.validate(json.loads(c.message.content), WEATHER_REPORT)
            assert c.finish_reason == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            bad.append((c.finish_reason, c.message.content, str(exc)[:200]))
    assert not bad, f"{len(bad)} of 200 samples do not validate, e.g. {bad[:3]}"
    assert len({c.message.content for c in choices}) > 1  # sampled, not one answer repeated


def _at_once(*calls):
    """Each call's result, the calls made at once: the engine batches their requests, where one after another
    each would take its own steps."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), TOOLS[name])


def _streamed_calls(stream) -> dict[int, tuple[list[tuple[str, str]], str | None, str]]:
    """Per choice: its calls (name, arguments), finish_reason and content."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            seen = out.setdefault(choice.index, {"calls": {}, "finish": None, "content": ""})
            seen["content"] += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    seen["calls"][tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    seen["calls"][tc.index][1] += tc.function.arguments
            seen["finish"] = choice.finish_reason or seen["finish"]
    return {i: ([tuple(c) for c in s["calls"].values()], s["finish"], s["content"]) for i, s in out.items()}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_parseable_calls(client, parallel):
    body = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", n=8, temperature=1.0,
                seed=3, max_tokens=200, parallel_tool_calls=parallel)
    out, streamed = _at_once(lambda: client.chat.completions.create(**body),
                             lambda: _streamed_calls(client.chat.completions.create(**body, stream=True)))
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        _check_calls(calls, set(TOOLS))
        assert parallel or len(calls) == 1
    assert len(streamed) == 8
    for calls, finish, content in streamed.values():
        assert finish == "tool_calls" and content == ""
        _check_calls(calls, set(TOOLS))
        assert parallel or len(calls) == 1


def test_a_named_function_always_gives_its_call(client):
    body = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=8, temperature=1.0, seed=4, max_tokens=120,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    out, streamed = _at_once(lambda: client.chat.completions.create(**body),
                             lambda: _streamed_calls(client.chat.completions.create(**body, stream=True)))
    for c in out.choices:
        assert c.finish_reason == "stop" and c.message.content is None, c
        (call,) = c.message.tool_calls
        _check_calls([(call.function.name, call.function.arguments)], {"get_time"})
    for calls, finish, content in streamed.values():
        assert finish == "stop" and content == "" and len(calls) == 1
        _check_calls(calls, {"get_time"})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_choice_regex_grammar_and_json_object_hold(client, endpoint):
    def sample(**extra) -> list[tuple[str, str]]:
        """(text, finish_reason) of four samples; ``extra`` goes in the body as vLLM's fields do."""
        common = dict(model=MODEL, n=4, temperature=1.0, seed=5, max_tokens=60)
        if endpoint == "completions":
            out = client.completions.create(prompt="The capital of France is", **common, extra_body=extra)
            return [(c.text, c.finish_reason) for c in out.choices]
        out = client.chat.completions.create(messages=ASK, **common, extra_body=extra)
        return [(c.message.content, c.finish_reason) for c in out.choices]

    assert {t for t, _ in sample(guided_choice=["Paris", "Rome"])} <= {"Paris", "Rome"}
    assert all(re.fullmatch(r"[0-9]{2}-[a-z]{3}", t) for t, _ in sample(guided_regex="[0-9]{2}-[a-z]{3}"))
    grammar = 'root ::= "yes" | "no" | "maybe"'
    assert {t for t, _ in sample(structured_outputs={"grammar": grammar})} <= {"yes", "no", "maybe"}
    # any JSON object may run past max_tokens at temperature 1; every one that ends is an object
    finished = [t for t, why in sample(response_format={"type": "json_object"}, max_tokens=200) if why == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished), finished


def test_json_has_no_free_whitespace_whichever_is_asked(client):
    """The engine's JSON grammar allows no free whitespace (vLLM's disable_any_whitespace): a small model at
    temperature 1 cannot spend max_tokens on newlines, and true or false, the output has one fixed layout."""
    def ask(disable: bool):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, n=4, temperature=1.0, seed=6, max_tokens=160,
            extra_body={"structured_outputs": {"json": WEATHER_REPORT, "disable_any_whitespace": disable}})

    for out in _at_once(lambda: ask(True), lambda: ask(False)):
        for c in out.choices:  # one layout: the grammar places every separator's space, the model none
            value = json.loads(c.message.content)
            assert c.message.content in (json.dumps(value), json.dumps(value, separators=(",", ":"))), c.message


def test_disaggregated_serving_keeps_the_constraint_across_the_handoff(smollm2_dir, tmp_path):
    """``kvrelay serve``'s default mode: the prefill worker samples the first token under the grammar, the
    decode worker continues its state; the API sees the same guarantees."""
    argv = ["--model", str(smollm2_dir), *(["--mode", "disaggregated"] + ENGINE[2:])]
    with Served(argv, tmp_path / "serve.log", timeout=300) as served:
        client = served.client()
        fmt = {"type": "json_schema", "json_schema": {"name": "weather_report", "schema": WEATHER_REPORT}}
        out, streamed = _at_once(
            lambda: client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, n=16,
                                                   temperature=1.0, seed=7, max_tokens=160),
            lambda: _streamed_calls(client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", n=4, temperature=1.0,
                seed=8, max_tokens=200, stream=True)))
        for c in out.choices:
            jsonschema.validate(json.loads(c.message.content), WEATHER_REPORT)
        for calls, finish, _ in streamed.values():
            assert finish == "tool_calls"
            _check_calls(calls, set(TOOLS))


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_engine_cannot_compile_is_a_400_naming_the_field(client, stream):
    """The gateway cannot parse EBNF; the engine's compile fails, and the answer names the request's field."""
    body = dict(model=MODEL, prompt="The capital of France is", max_tokens=5,
                extra_body={"guided_grammar": "root ::= undefined_rule"})
    if not stream:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**body)
        error = info.value.body
    else:
        with pytest.raises(openai.APIError) as info:
            for _ in client.completions.create(**body, stream=True):
                pass
        error = info.value.body
    assert error["param"] == "guided_grammar" and "does not compile" in error["message"], error
    # the worker goes on serving
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"guided_choice": ["a"]}
                                     ).choices[0].text == "a"


@pytest.mark.parametrize("field, value, param", [
    ("guided_grammar", 'root ::= "\\uD800"', "guided_grammar"),
    ("structured_outputs", {"regex": "[0-9]\\uD83D\\uDE00"}, "structured_outputs.regex"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "code", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]\\uDC00$"}}}}},
     "response_format.json_schema.schema"),
], ids=["grammar", "regex-pair", "json-pattern"])
def test_a_constraint_no_utf8_text_meets_is_a_400_naming_the_field(client, field, value, param):
    """A constraint that spells a UTF-16 surrogate (xgrammar would take it as bytes no UTF-8 text holds)
    is refused by the engine's compile, and the answer names the request's field."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Say", max_tokens=5, extra_body={field: value})
    error = info.value.body
    assert error["param"] == param, error
    assert re.match(rf"{re.escape(param)} does not compile: it spells U\+D[89A-F][0-9A-F]{{2}}, a UTF-16 surrogate",
                    error["message"]), error
