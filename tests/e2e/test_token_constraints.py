"""Token constraints on SmolLM2 served by a real gateway and worker: logit_bias bans and forces tokens within
OpenAI's limits (a worker refuses a job past them that skipped the gateway), and allowed_token_ids are the
only tokens sampled."""

import re

import pytest

from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.e2e.jobs import JobClient
from tests.e2e.request_fields import BASE, EOS, MODEL, PARIS, SAMPLED, VOCAB, ok, post, text


def test_logit_bias_bans_paris_and_forces_a_token(fields_http):
    assert text(ok(fields_http, BASE["completions"])).startswith(" Paris")
    banned = text(ok(fields_http, {**BASE["completions"], "logit_bias": {str(PARIS): -100}}))
    assert not banned.startswith(" Paris") and banned
    forced = ok(fields_http, {**BASE["completions"], "max_tokens": 3, "logit_bias": {"1010": 100}, "logprobs": 0})
    assert forced.json()["usage"]["completion_tokens"] == 3
    tokens_text = forced.json()["choices"][0]["logprobs"]["tokens"]
    single = fields_http.post("/detokenize", json={"model": MODEL, "tokens": [1010]}).json()["prompt"]
    assert tokens_text == [single] * 3
    chat = text(ok(fields_http, {**BASE["chat"], "max_tokens": 16}))
    assert "Paris" in chat
    assert "Paris" not in text(ok(fields_http, {**BASE["chat"], "max_tokens": 16, "logit_bias": {str(PARIS): -100}}))


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
def test_logit_bias_limits_are_400s(fields_http, endpoint, bias, why):
    r = post(fields_http, {**BASE[endpoint], "logit_bias": bias})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "logit_bias", error
    assert re.search(why, error["message"]), error


def test_worker_refuses_an_out_of_vocabulary_bias_and_keeps_serving(fields_http):
    """A job that skipped the gateway's checks (another gateway version, a forged job) errors that request
    alone: the worker answers the next one."""
    cluster = fields_http.cluster
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


@pytest.mark.parametrize("endpoint", list(BASE))
def test_allowed_token_ids_are_the_only_tokens_sampled(fields_http, endpoint):
    allowed = [PARIS, 1010, 28, EOS]
    for seed in range(3):
        body = {**BASE[endpoint], **SAMPLED, "seed": seed, "max_tokens": 8, "allowed_token_ids": allowed,
                "logprobs": 1 if endpoint == "completions" else True, "return_tokens_as_token_ids": True}
        lp = ok(fields_http, body).json()["choices"][0]["logprobs"]
        names = lp["tokens"] if endpoint == "completions" else [c["token"] for c in lp["content"]]
        assert names and {int(n.split(":")[1]) for n in names} <= set(allowed), names
    for bad, why in (([], "non-empty"), ([VOCAB], "out of vocabulary"), ([-1], "non-negative"), (["5"], "")):
        r = post(fields_http, {**BASE[endpoint], "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("allowed_token_ids"), r.text
        assert why in r.json()["error"]["message"]
