"""The gateway's TTFT stage split (gateway/ttft_stages.py) as its /metrics shows it after real requests, read with
kvrelay/ttft_readout.py: a first token without the worker's stamps is counted unsplit, once per choice; a stamped
one is split, all stages, which add up to the request's TTFT in both TTFT histograms; a job queued again after its
holder died is split too, the first run's time in ``requeue``. The fake worker stamps all four stamps at one
instant: only the gateway's stages take time here. The TTFT histograms count a first token as it is streamed,
not when its request ends."""

import json
import time

import httpx
import pytest
import requests

from kvrelay.gateway.ttft_stages import STAGES
from kvrelay.ttft_readout import Scrape, breakdown, diff, parse
from tests.integration.gateway_harness import MODEL, REPLY, running_stack
from tests.integration.tenant_harness import sample, scrape

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("ttft-stages")) as s:
        yield s


def _scrape(stack) -> Scrape:
    return parse(requests.get(f"{stack.url}/metrics", timeout=30).text)


def _split(stack, prompt: str, **body) -> dict:
    """The stage split of the requests of one completion, from /metrics before and after it."""
    before = _scrape(stack)
    out = requests.post(f"{stack.url}/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 32, **body})
    assert out.status_code == 200, out.text
    assert {c["text"] for c in out.json()["choices"]} == {REPLY}
    return breakdown(diff(before, _scrape(stack)))


def test_a_first_token_without_stamps_is_counted_unsplit_per_choice(stack):
    b = _split(stack, "hello there", n=2)
    assert (b["requests"], b["unsplit"], b["stages"]) == (0, 2, {})


def test_a_stamped_first_token_is_split_into_every_stage(stack):
    b = _split(stack, "[stamped] hello there")
    assert (b["requests"], b["unsplit"], list(b["stages"])) == (1, 0, list(STAGES))
    assert b["stages"]["requeue"]["mean_ms"] == 0  # queued once


def test_a_job_queued_again_after_its_holder_died_is_split_its_first_run_in_requeue(stack):
    b = _split(stack, "[requeue] hello there", temperature=0)
    assert (b["requests"], b["unsplit"], list(b["stages"])) == (1, 0, list(STAGES))
    # the gateway saw the holder gone at a poll after its announcement: the first run took time
    assert b["stages"]["requeue"]["mean_ms"] > 0


def test_a_stamped_requests_stages_add_up_to_its_ttft_exactly(stack):
    before_ttft = scrape(stack.url)
    b = _split(stack, "[stamped] hello there")
    after_ttft = scrape(stack.url)
    stages_ms = sum(s["mean_ms"] for s in b["stages"].values())  # one request: each stage's mean is its time
    request_ttft_ms = 1000 * (sample(after_ttft, "kvrelay_ttft_seconds_sum", model=MODEL)
                              - sample(before_ttft, "kvrelay_ttft_seconds_sum", model=MODEL))
    # one stamp of the first token for every series: equal to the float rounding of the sums, not within a tolerance
    assert stages_ms == pytest.approx(b["ttft_mean_ms"], rel=0, abs=1e-6)
    assert stages_ms == pytest.approx(request_ttft_ms, rel=0, abs=1e-6)


def test_a_first_token_is_in_the_ttft_histograms_while_its_stream_is_still_open(stack):
    """``[hold]`` sends one token and then nothing: the request is still running when the scrape comes."""
    before = scrape(stack.url)
    body = {"model": MODEL, "prompt": "[hold] hello there", "max_tokens": 32, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # held: a generator over it, dropped, would close the stream
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
        during = scrape(stack.url)
        assert sample(during, "kvrelay_requests_in_flight", model=MODEL) == 1
    for name, labels in (("kvrelay_ttft_seconds_count", {"model": MODEL}),
                         ("vllm:time_to_first_token_seconds_count", {"model_name": MODEL})):
        assert sample(during, name, **labels) - sample(before, name, **labels) == 1, name


def test_a_request_whose_body_is_slow_to_arrive_counts_that_time_in_its_gateway_stage(stack):
    # the TTFT runs from the request reaching the gateway's handlers, before its body is read: time the client or a
    # busy event loop takes there is in the gateway stage, not outside every histogram
    pause_s = 0.3
    body = json.dumps({"model": MODEL, "prompt": "[stamped] hello there", "max_tokens": 32}).encode()

    def slowly():
        yield body[:10]
        time.sleep(pause_s)
        yield body[10:]

    before = _scrape(stack)
    out = requests.post(f"{stack.url}/v1/completions", data=slowly(), timeout=60,
                        headers={"Content-Type": "application/json"})  # a generator: sent chunked
    assert out.status_code == 200, out.text
    b = breakdown(diff(before, _scrape(stack)))
    assert (b["requests"], b["unsplit"]) == (1, 0)
    assert b["stages"]["gateway"]["mean_ms"] >= pause_s * 1000
