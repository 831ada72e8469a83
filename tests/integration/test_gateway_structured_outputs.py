"""Every API name for an output constraint reaches the job as the one StructuredOutputs it means, on both
endpoints, and every bad or conflicting one is a 400 naming the field. Real Redis, ZMQ and gateway; the fake
worker of tests/integration/gateway_harness.py records the jobs it is given (the engine's side of the
constraint is tested with a real model in tests/e2e/test_structured_outputs.py)."""

import json

import httpx
import pytest

from kvrelay.shared.wire.structured_outputs import StructuredOutputs
from tests.integration.gateway_harness import MODEL, running_stack

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
# Sorted keys, no spaces: what the engine's compile cache is keyed by
CANONICAL = ('{"additionalProperties":false,"properties":{"age":{"minimum":0,"type":"integer"},'
             '"name":{"type":"string"}},"required":["name","age"],"type":"object"}')
BODIES = {"completions": {"model": MODEL, "prompt": "hello", "max_tokens": 3},
          "chat": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ENDPOINTS = pytest.mark.parametrize("endpoint", list(BODIES))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("structured")) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


def constraint_of(stack, http, endpoint: str, fields: dict) -> StructuredOutputs | None:
    r = http.post(PATHS[endpoint], json={**BODIES[endpoint], **fields})
    assert r.status_code == 200, r.text
    (job,) = stack.jobs_for(r.json()["id"].split("-", 1)[1])
    return job.sampling.structured_outputs


@ENDPOINTS
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
     StructuredOutputs(json=CANONICAL)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True,
                                                                  "description": "a person"}}},
     StructuredOutputs(json=CANONICAL)),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=CANONICAL)),
    # a string holding the schema, keys in another order and spaced: the same text reaches the engine
    ({"guided_json": json.dumps(dict(reversed(SCHEMA.items())), indent=2)}, StructuredOutputs(json=CANONICAL)),
    ({"guided_regex": "[0-9]{3}-[a-z]+"}, StructuredOutputs(regex="[0-9]{3}-[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputs(grammar='root ::= "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=CANONICAL)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputs(json=CANONICAL)),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputs(regex="a+")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputs(choice=["x"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
    ({"structured_outputs": {"regex": "a+", "disable_fallback": True, "disable_any_whitespace": False}},
     StructuredOutputs(regex="a+")),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}, StructuredOutputs(json_object=True)),
    ({"guided_regex": "a+", "guided_decoding_backend": "auto"}, StructuredOutputs(regex="a+")),
    # what asks for nothing
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_each_field_reaches_the_job_as_its_constraint(stack, http, endpoint, fields, expected):
    assert constraint_of(stack, http, endpoint, fields) == expected


@ENDPOINTS
@pytest.mark.parametrize("fields, param, why", [
    # more than one constraint: the message names them all, the param the last
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "response_format, guided_regex"),
    ({"guided_json": SCHEMA, "structured_outputs": {"regex": "a+"}}, "structured_outputs.regex",
     "guided_json, structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice", "one way"),
    ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_grammar", "guided_choice, guided_grammar"),
    # response_format's shape
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "needs schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "shema": SCHEMA}}},
     "response_format.json_schema.shema", ""),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema", "only read with type"),
    # schemas that are not JSON Schemas
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"guided_json": {"properties": {"a": {"minimum": "zero"}}}}, "guided_json", "not a valid JSON Schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "JSON Schema object"),
    ({"guided_json": [1]}, "guided_json", ""),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json", "not a valid JSON Schema"),
    # the other constraints' values
    ({"guided_regex": "a("}, "guided_regex", "not a valid regular expression"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_choice": []}, "guided_choice", "list of 1 to"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", 1]}, "guided_choice.1", ""),
    ({"guided_grammar": ""}, "guided_grammar", "non-empty"),
    ({"guided_grammar": "x" * (256 * 1024 + 1)}, "guided_grammar", "at most"),
    ({"structured_outputs": {}}, "structured_outputs", "must set one of"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "must set one of"),
    # vLLM's knobs on how the grammar is built: refused, never accepted and ignored
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ""),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "one grammar backend"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    # a complete document allows only its end: these would leave nothing to sample
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "guided_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response_format"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_bad_constraints_are_400s_naming_the_field(http, endpoint, fields, param, why):
    r = http.post(PATHS[endpoint], json={**BODIES[endpoint], **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert why in error["message"], error


def test_a_forced_tool_call_and_another_constraint_are_a_400(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = http.post(PATHS["chat"], json={**BODIES["chat"], "tools": [tool], "tool_choice": choice,
                                           "response_format": {"type": "json_object"}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tool_choice" and "response_format, tool_choice" in error["message"], error


def test_allowed_token_ids_and_a_constraint_both_reach_the_engine(stack, http):
    r = http.post(PATHS["completions"], json={**BODIES["completions"], "guided_regex": "[0-9]+",
                                               "allowed_token_ids": [5, 7]})
    assert r.status_code == 200, r.text
    (job,) = stack.jobs_for(r.json()["id"].split("-", 1)[1])
    assert job.sampling.allowed_token_ids == [5, 7]
    assert job.sampling.structured_outputs == StructuredOutputs(regex="[0-9]+")


def test_disable_additional_properties_is_what_the_engine_does_either_way(stack, http):
    for flag in (True, False):
        r = http.post(PATHS["completions"], json={**BODIES["completions"], "structured_outputs": {
            "json": SCHEMA, "disable_additional_properties": flag}})
        assert r.status_code == 200, r.text


def test_each_choice_of_n_carries_the_constraint(stack, http):
    r = http.post(PATHS["completions"], json={**BODIES["completions"], "n": 3, "guided_choice": ["a", "b"]})
    assert r.status_code == 200, r.text
    jobs = stack.jobs_for(r.json()["id"].split("-", 1)[1])
    assert len(jobs) == 3 and all(j.sampling.structured_outputs == StructuredOutputs(choice=["a", "b"]) for j in jobs)


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
])
def test_a_constraint_the_engine_cannot_compile_is_a_400_naming_the_field(http, fields, param):
    """The worker knows only the constraint's kind; the gateway names the field the request used."""
    body = {**BODIES["completions"], "prompt": "[error]", **fields}
    r = http.post(PATHS["completions"], json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] == f"{param} does not compile: fake", error
    streamed = http.post(PATHS["completions"], json={**body, "stream": True})
    (event,) = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert event["error"]["param"] == param, event
    # without a constraint a worker's error stays the server's
    assert http.post(PATHS["completions"], json={**BODIES["completions"], "prompt": "[error]"}).status_code == 500
