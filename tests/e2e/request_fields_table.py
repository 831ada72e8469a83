"""The one table of request fields: for each endpoint, every field of its schema (gateway/api/schemas.py;
nested fields as ``parent.child``, list items as ``parent[].child``) and every field of UNSUPPORTED_FIELDS,
each mapped to how it is covered:
  Effect     a request with the field set answers differently from one without it, on SmolLM2 served by a
             real gateway and worker (test_effect runs both and compares what ``observe`` reads);
  Rejected   a request with it is a 400 whose param names it (test_rejected);
  Elsewhere  the effect is not in one answer (scheduling order, which model answers): the test named covers
             it, and test_every_schema_field_is_in_the_table checks that the test exists;
  Justified  accepted, and cannot change an answer by definition: why.
The tests are in tests/e2e/test_request_fields.py; a field added to a schema without an entry here fails
test_every_schema_field_is_in_the_table.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvrelay.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from tests.e2e.request_fields import (
    CITY,
    EOS_FIRST,
    JSON_SCHEMA_FORMAT,
    PARIS,
    SAMPLED,
    cached,
    choices,
    content_type,
    logprobs,
    prompt_logprobs,
    text,
    tokens,
    usage_chunk,
    usage_chunks,
)


@dataclass(frozen=True)
class Effect:
    change: dict
    observe: Callable[[httpx.Response], Any]
    base: dict = field(default_factory=dict)  # on top of BASE, for both requests


@dataclass(frozen=True)
class Rejected:
    body: dict  # on top of BASE
    param: str | None = None  # the 400's param, when not the field's own name


@dataclass(frozen=True)
class Elsewhere:
    test: str  # path::function
    why: str


@dataclass(frozen=True)
class Justified:
    why: str


Coverage = Effect | Rejected | Elsewhere | Justified

SHARED: dict[str, Coverage] = {
    "model": Elsewhere("tests/e2e/test_multi_model.py::test_three_models_in_one_prefill_and_one_decode_worker",
                       "picks which model answers: needs two models (an unknown name is a 404)"),
    "max_tokens": Effect({"max_tokens": 2}, tokens),
    "temperature": Effect({"temperature": 1.5, "seed": 1}, text),
    "top_p": Effect({"top_p": 0.01}, text, base=SAMPLED),
    "top_k": Effect({"top_k": 1}, text, base=SAMPLED),
    "min_p": Effect({"min_p": 1.0}, text, base=SAMPLED),
    "seed": Effect({"seed": 2}, text, base=SAMPLED),
    "n": Effect({"n": 2}, choices),
    "use_beam_search": Elsewhere("tests/e2e/test_best_of_beam_search.py::test_beam_search_answers_as_the_offline_engine",
                                 "the best beams, as the offline engine's beam search finds them"),
    "length_penalty": Elsewhere("tests/e2e/test_best_of_beam_search.py::test_beam_search_answers_as_the_offline_engine",
                                "scores the beam search's hypotheses: compared with the offline engine's"),
    "best_of": Elsewhere("tests/e2e/test_best_of_beam_search.py::test_best_of_returns_the_most_likely_samples",
                         "picks among samples: the same choices sampled with n show which it must return"),
    "stream": Effect({"stream": True}, content_type),
    "stream_options": Effect({"stream_options": {"include_usage": True}}, usage_chunk, base={"stream": True}),
    "stream_options.include_usage": Effect({"stream_options": {"include_usage": True}}, usage_chunk,
                                           base={"stream": True}),
    "stream_options.continuous_usage_stats": Effect(
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, usage_chunks,
        base={"stream": True, "stream_options": {"include_usage": True}}),
    "stop": Effect({"stop": "Paris"}, text),
    # past EOS the answer repeats itself: penalties on output tokens have something to act on
    "presence_penalty": Effect({"presence_penalty": 2.0}, text, base={"max_tokens": 16, "ignore_eos": True}),
    "frequency_penalty": Effect({"frequency_penalty": 2.0}, text, base={"max_tokens": 16, "ignore_eos": True}),
    "repetition_penalty": Effect({"repetition_penalty": 1.5}, text),
    "user": Justified("OpenAI's end-user id for the provider's abuse monitoring: it cannot change an answer, "
                      "and kvrelay keeps no per-user record; accepted because OpenAI SDKs send it"),
    "store": Rejected({"store": True}),  # false asks for nothing (tests/integration/test_openai_fields.py)
    "metadata": Justified("OpenAI's tags for stored completions; kvrelay stores none, so they cannot change "
                          "an answer; accepted as OpenAI accepts them"),
    "service_tier": Rejected({"service_tier": "flex"}),  # "auto" asks for nothing
    "prompt_cache_key": Justified("OpenAI's hint for routing to a cache; kvrelay's prefix cache and prefix "
                                  "affinity find shared prefixes by themselves, so it cannot change an answer"),
    "safety_identifier": Justified("OpenAI's end-user id for abuse monitoring, like user: it cannot change an "
                                   "answer and kvrelay keeps no per-user record"),
    "ignore_eos": Effect({"ignore_eos": True}, tokens, base=EOS_FIRST),
    "min_tokens": Effect({"min_tokens": 2}, tokens, base=EOS_FIRST),
    "stop_token_ids": Effect({"stop_token_ids": [PARIS]}, text),
    "skip_special_tokens": Effect({"skip_special_tokens": False}, text, base={**EOS_FIRST, "ignore_eos": True}),
    "include_stop_str_in_output": Effect({"include_stop_str_in_output": True}, text, base={"stop": "Paris"}),
    "prompt_logprobs": Effect({"prompt_logprobs": 1}, prompt_logprobs),
    "priority": Elsewhere("tests/unit/test_llm_api.py::test_priority_policy_runs_urgent_requests_first",
                          "orders requests under --scheduling-policy priority; one answer's text cannot show it"),
    # the fixture sends BASE once, so the base request finds its prompt cached and a new salt does not
    "cache_salt": Effect({"cache_salt": "audit-salt"}, cached),
    "logit_bias": Effect({"logit_bias": {str(PARIS): -100}}, text),
    "allowed_token_ids": Effect({"allowed_token_ids": [1010]}, text),
    # output constraints (gateway/api/output_constraints.py): the grammar changes the answer
    "response_format": Effect({"response_format": {"type": "json_object"}}, text),
    "response_format.type": Effect({"response_format": {"type": "json_object"}}, text),
    "response_format.json_schema": Effect({"response_format": JSON_SCHEMA_FORMAT}, text),
    "response_format.json_schema.schema": Effect({"response_format": JSON_SCHEMA_FORMAT}, text),
    "response_format.json_schema.name": Justified("OpenAI's label for the schema, required there; the schema "
                                                  "is what constrains the answer"),
    "response_format.json_schema.strict": Justified("the schema is always enforced, which is what true asks for "
                                                    "and more than false does"),
    "response_format.json_schema.description": Justified(
        "describes the format for the developer's records; the answer is constrained to the schema either "
        "way, and vLLM reads it no more than kvrelay does (agent frameworks send it, so it is accepted)"),
    "guided_json": Effect({"guided_json": CITY}, text),
    "guided_regex": Effect({"guided_regex": "[0-9]{4}"}, text),
    "guided_choice": Effect({"guided_choice": ["Berlin", "Rome"]}, text),
    "guided_grammar": Effect({"guided_grammar": 'root ::= "yes" | "no"'}, text),
    "structured_outputs": Effect({"structured_outputs": {"choice": ["Berlin"]}}, text),
    "structured_outputs.json": Effect({"structured_outputs": {"json": CITY}}, text),
    "structured_outputs.regex": Effect({"structured_outputs": {"regex": "[0-9]{4}"}}, text),
    "structured_outputs.choice": Effect({"structured_outputs": {"choice": ["Berlin"]}}, text),
    "structured_outputs.grammar": Effect({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, text),
    "structured_outputs.json_object": Effect({"structured_outputs": {"json_object": True}}, text),
    "structured_outputs.disable_fallback": Justified("vLLM's permission to try another grammar backend; kvrelay "
                                                     "runs one and never falls back, whichever value is sent"),
    "structured_outputs.disable_any_whitespace": Elsewhere(
        "tests/e2e/test_structured_outputs.py::test_json_has_no_free_whitespace_whichever_is_asked",
        "the engine's JSON has no free whitespace, which true asks for and false permits"),
    "structured_outputs.disable_additional_properties": Elsewhere(
        "tests/unit/test_structured_backend.py::test_an_object_never_gains_a_property_its_schema_leaves_unstated",
        "vLLM's switch to make llguidance leave out unlisted properties as xgrammar does; the engine's xgrammar "
        "compiles schemas strictly, which true asks for and false permits"),
    "structured_outputs.whitespace_pattern": Rejected({"structured_outputs": {"json": CITY,
                                                                              "whitespace_pattern": " "}}),
    "guided_decoding_backend": Rejected({"guided_json": CITY, "guided_decoding_backend": "outlines"}),
    "guided_whitespace_pattern": Rejected({"guided_json": CITY, "guided_whitespace_pattern": " "}),
}

GERMANY = "What is the capital of Germany?"
FIELDS: dict[str, dict[str, Coverage]] = {
    "completions": {
        **SHARED,
        "prompt": Effect({"prompt": "The capital of Germany is"}, text),
        "logprobs": Effect({"logprobs": 1}, logprobs),
        "return_tokens_as_token_ids": Effect({"return_tokens_as_token_ids": True}, logprobs, base={"logprobs": 1}),
        "echo": Effect({"echo": True}, text),
        # SmolLM2's tokenizer has no fill-in-the-middle markers: tests/integration/test_gateway_fill_in_middle.py
        # shows the prompt built for one that has them
        "suffix": Rejected({"suffix": "!"}),
    },
    "chat": {
        **SHARED,
        "messages": Effect({"messages": [{"role": "user", "content": GERMANY}]}, text),
        "messages[].role": Effect({"messages": [{"role": "assistant", "content": "What is the capital of France?"}]},
                                  text),
        "messages[].content": Effect({"messages": [{"role": "user", "content": GERMANY}]}, text),
        "messages[].content[].type": Rejected({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                              "messages.0.content.0.type"),
        "messages[].content[].text": Effect({"messages": [{"role": "user", "content": [{"type": "text",
                                                                                          "text": GERMANY}]}]}, text),
        # SmolLM2's chat template renders neither: the gateway finds that by rendering without them
        "messages[].name": Rejected({"messages": [{"role": "user", "content": "Hi", "name": "bob"}]},
                                    "messages.0.name"),
        "chat_template_kwargs": Rejected({"chat_template_kwargs": {"enable_thinking": False}}),
        "logprobs": Effect({"logprobs": True}, logprobs),
        "return_tokens_as_token_ids": Effect({"return_tokens_as_token_ids": True}, logprobs,
                                             base={"logprobs": True}),
        "top_logprobs": Effect({"top_logprobs": 3}, logprobs, base={"logprobs": True}),
        "max_completion_tokens": Effect({"max_completion_tokens": 2}, tokens),
        "add_generation_prompt": Effect({"add_generation_prompt": False}, text),
        # SmolLM2's template renders no tools, and this server runs without --enable-auto-tool-choice
        "tools": Elsewhere("tests/e2e/test_tool_calling.py::test_a_template_that_renders_tools_offers_them",
                           "offered through a chat template that renders tools (SmolLM2's does not: a 400)"),
        "tools[].type": Rejected({"tools": [{"type": "retrieval", "function": {"name": "f"}}],
                                  "tool_choice": "none"}, "tools.0.type"),
        "tools[].function": Rejected({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools.0.function"),
        "tools[].function.name": Rejected({"tools": [{"type": "function", "function": {"name": "a b"}}],
                                           "tool_choice": "none"}, "tools.0.function.name"),
        "tools[].function.description": Elsewhere(
            "tests/e2e/test_tool_calling.py::test_a_template_that_renders_tools_offers_them",
            "rendered into the prompt by a template that renders tools"),
        "tools[].function.parameters": Rejected({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}], "tool_choice": "none"}, "tools.0.function.parameters"),
        "tools[].function.strict": Elsewhere(
            "tests/integration/test_gateway_forced_calls.py::test_strict_needs_a_forced_choice",
            "honoured by a forced call's grammar; with \"auto\" (not served here) a 400"),
        "tool_choice": Rejected({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}),
        "parallel_tool_calls": Elsewhere(
            "tests/integration/test_gateway_tools.py::test_parallel_tool_calls_false_keeps_the_first_call",
            "keeps the first of several calls: needs a reply that makes two"),
        "continue_final_message": Effect({"continue_final_message": True}, text, base={
            "add_generation_prompt": False, "messages": [{"role": "user", "content": "What is the capital of France?"},
                                                         {"role": "assistant", "content": "The capital of France is"}]}),
        "echo": Effect({"echo": True}, text, base={
            "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "The capital of France is"}]}),
    },
}
UNSUPPORTED_SAMPLES = {
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "functions": [{"name": "f"}],
    "function_call": "auto", "bad_words": ["Paris"], "logits_processors": ["x"],
    "truncate_prompt_tokens": 2, "prediction": {"type": "content", "content": "x"}, "audio": {"voice": "x"},
    "modalities": ["audio"], "reasoning_effort": "low",
}
for _endpoint in FIELDS.values():  # chat's own tools entries stay: chat implements those fields
    _endpoint.update({name: Rejected({name: value}) for name, value in UNSUPPORTED_SAMPLES.items()
                      if name not in _endpoint})
SCHEMAS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
