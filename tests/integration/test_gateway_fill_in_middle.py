"""Completions' ``suffix`` (fill in the middle) through the gateway: with a tokenizer that has the markers,
the job's prompt is prefix marker, prompt, suffix marker, suffix, middle marker; without them, and with
what cannot be filled, a 400 naming suffix. Real Redis, ZMQ and gateway; the fake worker of
tests/integration/gateway_harness.py records the jobs. SmolLM2 has no markers: tests/e2e/test_request_fields.py
sees its 400."""

import pytest

from tests.integration.gateway_harness import MODEL, post, running_stack

pytestmark = pytest.mark.timeout(120)

MARKERS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
BODY = {"model": MODEL, "prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))", "max_tokens": 3}


@pytest.fixture(scope="module")
def fim_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("fim"), extra_special=MARKERS) as s:
        yield s


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("fim-plain")) as s:
        yield s


def test_the_prompt_asks_for_the_middle(fim_stack):
    r = post(fim_stack, BODY)
    assert r.status_code == 200, r.text
    (job,) = fim_stack.jobs_for(r.json()["id"].split("-", 1)[1])
    tok = fim_stack.tokenizer
    pre, suf, mid = tok.convert_tokens_to_ids(list(MARKERS))
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert job.prompt_token_ids == [pre, *encode(BODY["prompt"]), suf, *encode(BODY["suffix"]), mid]
    assert r.json()["usage"]["prompt_tokens"] == len(job.prompt_token_ids)
    # several prompts: each gets the suffix
    r = post(fim_stack, {**BODY, "prompt": ["x = ", "y = "]})
    jobs = fim_stack.jobs_for(r.json()["id"].split("-", 1)[1])
    assert sorted(j.prompt_token_ids[1:-1] for j in jobs) == sorted(
        [*encode(p), suf, *encode(BODY["suffix"])] for p in ("x = ", "y = "))


def test_an_empty_suffix_asks_for_nothing(fim_stack, plain_stack):
    for stack in (fim_stack, plain_stack):
        r = post(stack, {**BODY, "suffix": ""})
        assert r.status_code == 200, r.text
        (job,) = stack.jobs_for(r.json()["id"].split("-", 1)[1])
        assert job.prompt_token_ids == stack.tokenizer.encode(BODY["prompt"])


@pytest.mark.parametrize("fields, why", [
    ({"prompt": [1, 2, 3]}, "as text"),
    ({"echo": True}, "cannot be combined"),
    ({"suffix": 5}, ""),
])
def test_what_cannot_be_filled_is_a_400(fim_stack, fields, why):
    r = post(fim_stack, {**BODY, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and why in error["message"], error


def test_a_model_without_the_markers_is_a_400(plain_stack):
    r = post(plain_stack, BODY)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and "fill-in-the-middle tokens" in error["message"], error
