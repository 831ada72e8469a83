"""``best_of`` through the gateway: best_of jobs sampled per prompt (each with the sampled tokens' logprobs,
which rank them), n returned and numbered, every sampled token in the usage, logprobs shown only when asked
for, and what cannot work a 400 naming best_of. Real Redis, ZMQ and gateway with the fake worker of
tests/integration/gateway_harness.py, whose choices all score alike; tests/e2e/test_best_of_beam_search.py checks
the ranking on a real model."""

import pytest

from tests.integration.gateway_harness import MODEL, post, running_stack

pytestmark = pytest.mark.timeout(120)

PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("best-of")) as s:
        yield s


@pytest.mark.parametrize("body", [PROMPT, CHAT])
def test_best_of_samples_more_and_returns_n(stack, body):
    r = post(stack, {**body, "best_of": 3, "n": 2, "seed": 7})
    assert r.status_code == 200, r.text
    out = r.json()
    jobs = stack.jobs_for(out["id"].split("-", 1)[1])
    assert len(jobs) == 3 and all(j.sampling.logprobs == 0 for j in jobs)  # ranked by the sampled tokens' logprobs
    assert sorted(j.sampling.seed for j in jobs) == [7, 8, 9]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])  # not asked for: not shown
    assert out["usage"]["completion_tokens"] == 3 * 3  # every sampled choice's tokens


def test_best_of_over_several_prompts_numbers_the_choices_prompt_by_prompt(stack):
    r = post(stack, {**PROMPT, "prompt": ["hi", "hello there"], "best_of": 2, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"].startswith("hi") and choices[1]["text"].startswith("hello there")
    assert all(c["logprobs"]["tokens"] for c in choices)  # asked for: shown
    assert len(stack.jobs_for(r.json()["id"].split("-", 1)[1])) == 4


def test_best_of_equal_to_n_is_plain_sampling_and_streams(stack):
    r = post(stack, {**PROMPT, "best_of": 2, "n": 2, "stream": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream"), r.text
    r = post(stack, {**PROMPT, "best_of": 2, "n": 2})
    assert all(j.sampling.logprobs is None for j in stack.jobs_for(r.json()["id"].split("-", 1)[1]))


@pytest.mark.parametrize("fields, why", [
    ({"best_of": 1, "n": 2}, "at least n"),
    ({"best_of": 0}, "best_of must be in"),
    ({"best_of": 1000}, "best_of must be in"),
    ({"best_of": 3, "stream": True}, "cannot be streamed"),
    ({"best_of": "3"}, ""),
])
def test_bad_best_of_is_a_400(stack, fields, why):
    for body in (PROMPT, CHAT):
        r = post(stack, {**body, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "best_of" and why in error["message"], error
