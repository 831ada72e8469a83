"""``use_beam_search`` through the gateway: the search runs over the workers, one job per live beam and step
(one greedy token, the best keep = 2 x width logprobs), and returns the n best hypotheses, with their tokens'
logprobs when asked, streamed when asked (each choice whole), one request to the TTFT histogram; what beam
search cannot honour is a 400 naming the field. Real Redis, ZMQ and gateway with the fake worker of
tests/integration/gateway_harness.py, whose every job offers the same three tokens (the reply's next token at
-0.5, the id after it at -1.5, id 0 at -inf), so the search's path is known; tests/e2e/test_best_of_beam_search.py
compares it with the offline engine's beam search on a real model."""

import json

import httpx
import pytest

from tests.integration.gateway_harness import MODEL, REPLY, api_path, post, running_stack
from tests.integration.tenant_harness import sample, scrape

pytestmark = pytest.mark.timeout(120)

PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "use_beam_search": True, "n": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "use_beam_search": True,
        "n": 2}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("beams")) as s:
        yield s


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_the_search_steps_over_the_workers_and_returns_the_best_beams(stack, body):
    tok = stack.tokenizer
    a = tok.encode(REPLY, add_special_tokens=False)[0]  # what the fake worker's every job answers first
    before = len(stack.worker.jobs)
    r = post(stack, body)
    assert r.status_code == 200, r.text
    out = r.json()
    # three steps: one beam, then the two best (a at -1.0; a, a+1 at -2.0 ahead of a+1, a: the first beam's first)
    jobs = stack.worker.jobs[before:]
    assert len(jobs) == 1 + 2 + 2
    assert all(j.sampling.max_tokens == 1 and j.sampling.temperature == 0 and j.sampling.logprobs == 4 for j in jobs)
    prompt = jobs[0].prompt_token_ids
    assert sorted(j.prompt_token_ids for j in jobs[3:]) == sorted([prompt + [a, a], prompt + [a, a + 1]])
    # the last step's two best hypotheses: a a a (-1.5), then a a a+1 (-2.5)
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in out["choices"]]
    assert texts == [tok.decode([a, a, a]), tok.decode([a, a, a + 1])]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["prompt_tokens"] == len(prompt)


def test_a_search_is_one_request_to_the_ttft_histogram_however_many_steps_it_takes(stack):
    before = scrape(stack.url)
    assert post(stack, PROMPT).status_code == 200
    after = scrape(stack.url)
    assert sample(after, "kvrelay_ttft_seconds_count", model=MODEL) - sample(before, "kvrelay_ttft_seconds_count",
                                                                             model=MODEL) == 1


def test_best_of_widens_the_beam(stack):
    before = len(stack.worker.jobs)
    r = post(stack, {**PROMPT, "n": 1, "best_of": 3, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    jobs = stack.worker.jobs[before:]
    assert len(jobs) == 1 + 3 and all(j.sampling.logprobs == 6 for j in jobs)


@pytest.mark.parametrize("fields, param", [
    ({"top_p": 0.5}, "top_p"),
    ({"seed": 0}, "seed"),
    ({"stop": ["x"]}, "stop"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logprobs": -1}, "logprobs"),  # the whole vocabulary: a step fetches at most 20
    ({"echo": True}, "echo"),
    ({"min_tokens": 1}, "min_tokens"),
    ({"best_of": 11}, "best_of"),  # 22 logprobs a step: past the 20 a job may ask for
    ({"best_of": 1}, "best_of"),  # narrower than n
    ({"guided_regex": "a+"}, "structured_outputs"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
])
def test_what_beam_search_cannot_honour_is_a_400(stack, fields, param):
    r = post(stack, {**PROMPT, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_asking_for_nothing_is_accepted(stack):
    r = post(stack, {**PROMPT, "temperature": 0, "top_p": 1, "seed": None, "stop": [], "logprobs": None})
    assert r.status_code == 200, r.text


def test_length_penalty_needs_beam_search(stack):
    r = post(stack, {**PROMPT, "use_beam_search": False, "n": 1, "length_penalty": 2.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
    assert post(stack, {**PROMPT, "length_penalty": 2.0}).status_code == 200


def test_logprobs_are_each_beam_tokens_and_their_best_alternatives(stack):
    tok = stack.tokenizer
    a = tok.encode(REPLY, add_special_tokens=False)[0]
    before = len(stack.worker.jobs)
    r = post(stack, {**PROMPT, "logprobs": 5})
    assert r.status_code == 200, r.text
    # a step asks for what the search keeps or what the request wants, whichever is more
    assert all(j.sampling.logprobs == 5 for j in stack.worker.jobs[before:])
    best, second = (c["logprobs"] for c in r.json()["choices"])
    assert best["tokens"] == [tok.decode([a])] * 3 and best["token_logprobs"] == [-0.5] * 3
    assert second["tokens"] == [tok.decode([a])] * 2 + [tok.decode([a + 1])]
    assert second["token_logprobs"] == [-0.5, -0.5, -1.5]
    # the token itself first (vLLM's order), then the step's alternatives, best first
    assert list(second["top_logprobs"][2]) == [tok.decode([a + 1]), tok.decode([a]), tok.decode([0])]
    assert best["text_offset"] == [0, len(tok.decode([a])), 2 * len(tok.decode([a]))]
    chat = post(stack, {**CHAT, "logprobs": True, "top_logprobs": 1}).json()["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"], len(t["top_logprobs"])) for t in chat] == [(tok.decode([a]), -0.5, 1)] * 3


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_a_streamed_search_sends_each_choice_whole_when_it_ends(stack, body):
    whole = post(stack, body).json()
    events = []
    with httpx.stream("POST", f"{stack.url}{api_path(body)}",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    *choices, usage = events
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for event, expected in zip(choices, whole["choices"], strict=True):
        (choice,) = event["choices"]
        assert choice["index"] == expected["index"] and choice["finish_reason"] == expected["finish_reason"]
        if "text" in expected:
            assert choice["text"] == expected["text"]
        else:
            assert choice["delta"] == {"role": "assistant", "content": expected["message"]["content"]}
