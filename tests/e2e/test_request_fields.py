"""Every request field either changes what a real model answers or is a 400 (issue #13, item 4).

FIELDS is the one table. For each endpoint it holds every field of its schema (gateway/api/schemas.py; nested
fields as ``parent.child``, list items as ``parent[].child``) and every field of UNSUPPORTED_FIELDS, each
mapped to how it is covered:
  Effect     a request with the field set answers differently from one without it, on SmolLM2 served by a
             real gateway and worker (test_effect runs both and compares what ``observe`` reads);
  Rejected   a request with it is a 400 whose param names it (test_rejected);
  Elsewhere  the effect is not in one answer (scheduling order, which model answers): the test named covers
             it, and test_every_schema_field_is_in_the_table checks that the test exists;
  Justified  accepted, and cannot change an answer by definition: why.
A field added to a schema without an entry here fails test_every_schema_field_is_in_the_table.
"""

import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from kvrelay.gateway.api.schemas import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.e2e.cluster import Cluster
from tests.e2e.jobs import JobClient

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


def text(r: httpx.Response) -> str:
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


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
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return sum(1 for e in events if e.get("usage"))


def choices(r: httpx.Response) -> int:
    return len(r.json()["choices"])


def content_type(r: httpx.Response) -> str:
    return r.headers["Content-Type"].split(";")[0]


def usage_chunk(r: httpx.Response) -> bool:
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return any(e.get("usage") for e in events)


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
    "use_beam_search": Elsewhere("tests/e2e/test_request_fields.py::test_beam_search_answers_as_the_offline_engine",
                                 "the best beams, as the offline engine's beam search finds them"),
    "length_penalty": Elsewhere("tests/e2e/test_request_fields.py::test_beam_search_answers_as_the_offline_engine",
                                "scores the beam search's hypotheses: compared with the offline engine's"),
    "best_of": Elsewhere("tests/e2e/test_request_fields.py::test_best_of_returns_the_most_likely_samples",
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


def schema_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        name = info.alias or name  # a field whose name Python reserves ("schema", "json"): the API's name
        out.add(prefix + name)
        for nested, many in _nested(info.annotation):
            out |= schema_fields(nested, f"{prefix}{name}{'[]' if many else ''}.")
    return out


def _nested(tp: Any, many: bool = False):
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, many
        return
    for arg in typing.get_args(tp):
        yield from _nested(arg, many or typing.get_origin(tp) is list)


def _cases(kind: type) -> list:
    return [pytest.param(endpoint, name, cov, id=f"{endpoint}:{name}")
            for endpoint, table in FIELDS.items() for name, cov in table.items() if isinstance(cov, kind)]


@pytest.mark.parametrize("endpoint", list(SCHEMAS))
def test_every_schema_field_is_in_the_table(endpoint):
    want = schema_fields(SCHEMAS[endpoint]) | set(UNSUPPORTED_FIELDS)
    have = set(FIELDS[endpoint])
    assert not want - have, f"{endpoint}: fields with no coverage entry in FIELDS: {sorted(want - have)}"
    assert not have - want, f"{endpoint}: FIELDS names fields the schema lacks: {sorted(have - want)}"
    root = Path(__file__).parents[2]
    for name, cov in FIELDS[endpoint].items():
        if isinstance(cov, Elsewhere):
            path, func = cov.test.split("::")
            assert re.search(rf"^def {func}\(", (root / path).read_text(), re.M), f"{name}: {cov.test} is gone"


@pytest.fixture(scope="module")
def http(smollm2_dir, tmp_path_factory):
    with EmbeddedRedis() as redis_url:
        cluster = Cluster(redis_url, str(smollm2_dir), ENGINE, tmp_path_factory.mktemp("request-fields"))
        # cache_salt's effect reads cached_tokens; logprobs of -1 (the whole vocabulary) need the bound lifted
        cluster.start_gateway(extra=["--enable-prompt-tokens-details", "--max-logprobs", "-1"])
        cluster.start_worker("unified", "u1")
        try:
            cluster.wait_ready(timeout=300)
            with httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}", timeout=120) as client:
                client.cluster = cluster
                ids = client.post("/tokenize", json={"model": MODEL, "prompt": " Paris<|im_end|>",
                                                     "add_special_tokens": False}).json()["tokens"]
                assert ids == [PARIS, EOS]
                for base in BASE.values():  # the prefix cache holds each base prompt from here on
                    post(client, base)
                yield client
        finally:
            cluster.stop()


def post(client: httpx.Client, body: dict) -> httpx.Response:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    return client.post(path, json=body)


def ok(client: httpx.Client, body: dict) -> httpx.Response:
    r = post(client, body)
    assert r.status_code == 200, r.text
    return r


_BASELINES: dict[str, httpx.Response] = {}


def baseline(client: httpx.Client, body: dict) -> httpx.Response:
    """Every baseline is greedy or seeded, so the same body answers the same: each is asked once (most
    fields share one, and every request is a real model's CPU time)."""
    key = json.dumps(body, sort_keys=True)
    if key not in _BASELINES:
        _BASELINES[key] = ok(client, body)
    return _BASELINES[key]


@pytest.mark.parametrize("endpoint, name, cov", _cases(Effect))
def test_effect(http, endpoint, name, cov: Effect):
    base = {**BASE[endpoint], **cov.base}
    without = cov.observe(baseline(http, base))
    with_field = cov.observe(ok(http, {**base, **cov.change}))
    assert with_field != without, f"{name} set or not, the answer reads {without!r}"


@pytest.mark.parametrize("endpoint, name, cov", _cases(Rejected))
def test_rejected(http, endpoint, name, cov: Rejected):
    r = post(http, {**BASE[endpoint], **cov.body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == (cov.param or name), error


def test_unsupported_fields_at_their_off_value_are_accepted(http):
    off = {"response_format": {"type": "text"}, "tools": [], "best_of": 1, "use_beam_search": False,
           "guided_decoding_backend": "auto"}
    assert text(ok(http, {**BASE["completions"], **off})) == text(ok(http, BASE["completions"]))


# --- logit_bias, item 3 of the part: its effect and its limits --------------------------------------------

def test_logit_bias_bans_paris_and_forces_a_token(http):
    assert text(ok(http, BASE["completions"])).startswith(" Paris")
    banned = text(ok(http, {**BASE["completions"], "logit_bias": {str(PARIS): -100}}))
    assert not banned.startswith(" Paris") and banned
    forced = ok(http, {**BASE["completions"], "max_tokens": 3, "logit_bias": {"1010": 100}, "logprobs": 0})
    assert forced.json()["usage"]["completion_tokens"] == 3
    tokens_text = forced.json()["choices"][0]["logprobs"]["tokens"]
    single = http.post("/detokenize", json={"model": MODEL, "tokens": [1010]}).json()["prompt"]
    assert tokens_text == [single] * 3
    chat = text(ok(http, {**BASE["chat"], "max_tokens": 16}))
    assert "Paris" in chat
    assert "Paris" not in text(ok(http, {**BASE["chat"], "max_tokens": 16, "logit_bias": {str(PARIS): -100}}))


@pytest.mark.parametrize("endpoint", list(BASE))
@pytest.mark.parametrize("bias, why", [
    ({str(i): 1 for i in range(301)}, "at most 300"),
    ({str(PARIS): 100.5}, r"\[-100, 100\]"),
    ({str(PARIS): -101}, r"\[-100, 100\]"),
    ({str(VOCAB): -100}, "out of vocabulary"),
    ({"-1": 5}, "token ids"),
    ({"Paris": 5}, "token ids"),
    ({"7042.0": 5}, "token ids"),
    ({" 7042": 5}, "token ids"),
    ({str(PARIS): "5"}, "numbers"),
    ({str(PARIS): True}, "numbers"),
    ([PARIS], "logit_bias"),
])
def test_logit_bias_limits_are_400s(http, endpoint, bias, why):
    r = post(http, {**BASE[endpoint], "logit_bias": bias})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "logit_bias", error
    assert re.search(why, error["message"]), error


def test_worker_refuses_an_out_of_vocabulary_bias_and_keeps_serving(http):
    """A job that skipped the gateway's checks (another gateway version, a forged job) errors that request
    alone: the worker answers the next one."""
    cluster = http.cluster
    client = JobClient(cluster.redis, MODEL)
    try:
        client.submit("bad-bias", [1, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=2,
                                                                   logit_bias={VOCAB + 5: 1.0}))
        assert client.wait(["bad-bias"])[0].finish_reason == "error"
        client.submit("good", [1, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=2,
                                                               logit_bias={PARIS: 100.0}))
        assert client.wait(["good"])[0].tokens == [PARIS, PARIS]
    finally:
        client.close()
    assert cluster.procs["u1"].poll() is None


# --- prompt_logprobs ranks: the prompt token's place in the whole vocabulary, the best k ranked 1..k ---------

@pytest.mark.parametrize("endpoint", list(BASE))
def test_prompt_logprobs_rank_the_prompt_token_in_the_whole_vocabulary(http, endpoint):
    entries = prompt_logprobs(ok(http, {**BASE[endpoint], "prompt_logprobs": 3}))
    assert entries[0] is None
    prompt_ids = http.post("/tokenize", json={"model": MODEL, **({"prompt": BASE[endpoint]["prompt"]}
                           if endpoint == "completions" else {"messages": BASE[endpoint]["messages"]})}).json()["tokens"]
    assert len(entries) == len(prompt_ids)
    unlikely = 0
    for position, token in zip(entries[1:], prompt_ids[1:], strict=True):
        own = position[str(token)]
        assert list(position)[0] == str(token)  # the prompt token first, as vLLM orders them
        best = sorted(((e["logprob"], t) for t, e in position.items() if t != str(token)), reverse=True)
        ranked = [position[t]["rank"] for _, t in best]
        if own["rank"] <= 3:  # among the best three: it holds its own rank, the others the remaining ones
            assert sorted(ranked + [own["rank"]]) == [1, 2, 3]
        else:  # below them: the best three are 1..3, each at least as likely as the prompt token
            unlikely += 1
            assert ranked == [1, 2, 3] and all(lp >= own["logprob"] for lp, _ in best)
    assert unlikely, "every prompt token was among the model's best three: the prompt shows no true rank"


def test_echo_with_logprobs_gives_the_prompt_tokens_their_logprobs(http):
    body = {**BASE["completions"], "max_tokens": 2, "logprobs": 2}
    echoed = ok(http, {**body, "echo": True}).json()["choices"][0]
    plain = ok(http, {**body, "prompt_logprobs": 2}).json()["choices"][0]
    prompt = BASE["completions"]["prompt"]
    assert echoed["text"] == prompt + plain["text"]
    n = len(plain["prompt_logprobs"])
    lp = echoed["logprobs"]
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"] and lp["token_logprobs"][0] is None
    for i, entry in enumerate(plain["prompt_logprobs"][1:], start=1):
        own = next(iter(entry.values()))  # the prompt token first
        assert lp["token_logprobs"][i] == pytest.approx(own["logprob"], abs=1e-5)
        assert lp["tokens"][i] == own["decoded_token"]
    assert lp["text_offset"][n] == len(prompt)
    # streamed (vLLM's way): the prompt and its logprobs lead the first chunk; joined, the whole reply
    streamed = post(http, {**body, "echo": True, "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["text"].startswith(prompt) and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == echoed["text"]
    joined = {key: [v for c in chunks for v in c["logprobs"][key]] for key in lp}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert [t and sorted(t) for t in joined["top_logprobs"]] == [t and sorted(t) for t in lp["top_logprobs"]]


@pytest.mark.parametrize("endpoint", list(BASE))
def test_allowed_token_ids_are_the_only_tokens_sampled(http, endpoint):
    allowed = [PARIS, 1010, 28, EOS]
    for seed in range(3):
        body = {**BASE[endpoint], **SAMPLED, "seed": seed, "max_tokens": 8, "allowed_token_ids": allowed,
                "logprobs": 1 if endpoint == "completions" else True, "return_tokens_as_token_ids": True}
        lp = ok(http, body).json()["choices"][0]["logprobs"]
        names = lp["tokens"] if endpoint == "completions" else [c["token"] for c in lp["content"]]
        assert names and {int(n.split(":")[1]) for n in names} <= set(allowed), names
    for bad, why in (([], "non-empty"), ([VOCAB], "out of vocabulary"), ([-1], "non-negative"), (["5"], "")):
        r = post(http, {**BASE[endpoint], "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("allowed_token_ids"), r.text
        assert why in r.json()["error"]["message"]


def test_logprobs_of_minus_one_are_the_whole_vocabulary(http):
    """With --max-logprobs -1 (the default 20 refuses it: tests/integration/test_openai_fields.py)."""
    body = {**BASE["completions"], "max_tokens": 1, "return_tokens_as_token_ids": True}  # ids: keys stay unique
    top = ok(http, {**body, "logprobs": -1}).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == VOCAB and {int(k.split(":")[1]) for k in top} == set(range(VOCAB))
    assert max(top.values()) == top[f"token_id:{PARIS}"]  # greedy took the best
    chat = ok(http, {**BASE["chat"], "max_tokens": 1, "logprobs": True, "top_logprobs": -1}).json()
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == VOCAB
    positions = prompt_logprobs(ok(http, {**BASE["completions"], "max_tokens": 1, "prompt_logprobs": -1}))
    assert all(len(p) == VOCAB and sorted(e["rank"] for e in p.values()) == list(range(1, VOCAB + 1))
               for p in positions[1:])


@pytest.mark.parametrize("endpoint", list(BASE))
def test_best_of_returns_the_most_likely_samples(http, endpoint):
    """Choice i of a seeded request is sampled with seed + i, so n=4 shows the four samples best_of=4 ranks:
    it returns the two whose tokens' logprobs sum highest."""
    body = {**BASE[endpoint], **SAMPLED, "max_tokens": 8}
    asked = {"logprobs": 0} if endpoint == "completions" else {"logprobs": True}
    samples = ok(http, {**body, **asked, "n": 4}).json()["choices"]

    def score(choice: dict) -> float:
        lp = choice["logprobs"]
        return sum(lp["token_logprobs"]) if endpoint == "completions" else sum(e["logprob"] for e in lp["content"])

    best = sorted(samples, key=score, reverse=True)[:2]
    out = ok(http, {**body, "best_of": 4, "n": 2}).json()
    assert [text(httpx.Response(200, json={"choices": [c]})) for c in out["choices"]] == \
        [text(httpx.Response(200, json={"choices": [c]})) for c in best]
    assert all(c["logprobs"] is None for c in out["choices"])
    assert len({text(httpx.Response(200, json={"choices": [c]})) for c in samples}) > 1  # they differ


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_answers_as_the_offline_engine(http, smollm2_dir, length_penalty):
    """The gateway's search over the worker (one job per beam and step) finds the beams the offline LLM's
    search over its engine finds: same model, same scoring."""
    from kvrelay.llm import LLM

    prompt = BASE["completions"]["prompt"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "use_beam_search": True, "n": 2, "best_of": 3,
            "length_penalty": length_penalty}
    served = ok(http, body).json()["choices"]
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, block_size=4, num_gpu_blocks=512, device="cpu")
    offline = llm.generate(prompt, SamplingParams(use_beam_search=True, n=2, beam_width=3, max_tokens=8,
                                                  length_penalty=length_penalty))[0].outputs
    assert [c["text"] for c in served] == [o.text for o in offline]
    assert [c["finish_reason"] for c in served] == [o.finish_reason for o in offline]
