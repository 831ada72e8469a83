"""The gateway's TTFT stage split (gateway/ttft_stages.py) as its /metrics shows it after real requests, read with
kvrelay/ttft_readout.py: a first token without the worker's stamps is counted unsplit, once per choice; a stamped
one is split, all stages; a job queued again after its holder died is split too, the first run's time in
``requeue``. The fake worker stamps all four stamps at one instant: only the gateway's stages take time here."""

import pytest
import requests

from kvrelay.gateway.ttft_stages import STAGES
from kvrelay.ttft_readout import Scrape, breakdown, diff, parse
from tests.integration.gateway_harness import MODEL, REPLY, running_stack

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
