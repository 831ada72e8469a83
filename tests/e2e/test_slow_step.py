"""A unified worker whose engine step is slow, or stuck, serving a request through a gateway, beside a peer.
A step longer than the registration's TTL and the peers' reclaim time (a long prefill on a CPU) is not a dead
worker: its heartbeat and its job keeper do not wait for the step, so its record never lapses, no peer
reclaims its job, and the request completes there. A step that never returns outlasts ``--step-timeout``: the
worker leaves the registry and exits, and the request, whose job it never finished, completes on a peer with
the offline engine's greedy text. The held step (until the test says, or for good) stands in for a long
prefill or a device that stopped answering: Python run before the CLI in the worker's process."""

import concurrent.futures
import time

import openai
import pytest

from kvrelay import SamplingParams
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.worker.stall_watch import STUCK_EXIT_CODE
from tests.conftest import random_prompts
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.test_serve_killed_rank import RECLAIM_MS, _holds_jobs, _wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MAX_TOKENS = 16
SLOW_S = keys.HEARTBEAT_TTL_S + 2 * keys.HEARTBEAT_INTERVAL_S  # two beats past the record's TTL

# the first step with a request in it takes ``{hold}``; warm-up is skipped, or its steps would be the first
_FIRST_STEP = """
import os, threading, time
from kvrelay.shared.engine.engine_core import EngineCore
step = EngineCore.step
held = []
def first_step_held(self):
    if self.has_unfinished() and not held:
        held.append(True)
        print("the held step begins", flush=True)
        {hold}
        print("the held step ends", flush=True)
    return step(self)
EngineCore.step = first_step_held
"""
STUCK = _FIRST_STEP.format(hold="threading.Event().wait()")


@pytest.fixture()
def greedy(tiny_offline):
    """A prompt and the offline engine's greedy text for it."""
    (prompt,) = random_prompts(1, lo=5, hi=30, seed=7)
    (out,) = tiny_offline.generate({"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return prompt, tiny_offline.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)


def _ask(cluster: Cluster, pool: concurrent.futures.Executor, prompt: list[int]) -> concurrent.futures.Future:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=240)
    return pool.submit(client.completions.create, model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                       temperature=0.0, extra_body={"ignore_eos": True})


def test_a_step_longer_than_the_ttl_and_the_reclaim_time_keeps_its_worker_and_its_job(greedy, tiny_model_dir,
                                                                                       redis_url, tmp_path):
    prompt, want = greedy
    over = tmp_path / "step-over"
    held = _FIRST_STEP.format(hold=f"while not os.path.exists({str(over)!r}): time.sleep(0.1)")
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    cluster.start_gateway()
    reclaim = ["--reclaim-idle-ms", str(RECLAIM_MS)]
    cluster.start_worker("unified", "u-slow", ["--skip-warmup", *reclaim], prelude=held)
    lapsed = 0
    try:
        cluster.wait_ready(timeout=300)
        cluster.wait_worker("u-slow", timeout=300)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = _ask(cluster, pool, prompt)
            _wait("the slow step", lambda: "the held step begins" in cluster.log("u-slow"))
            cluster.start_worker("unified", "u-peer", reclaim)  # only now: the job had to go to u-slow
            cluster.wait_worker("u-peer", timeout=300)
            # the peer up, the step goes on past the record's TTL and many times the reclaim time
            until = time.monotonic() + SLOW_S
            while time.monotonic() < until:
                lapsed += cluster.worker("u-slow") is None
                time.sleep(0.2)
            over.touch()
            text = answer.result(timeout=240).choices[0].text
        _wait("the slow step's end", lambda: "the held step ends" in cluster.log("u-slow"))
        assert cluster.procs["u-slow"].poll() is None
        reclaimed = "reclaimed job" in cluster.log("u-peer")
    finally:
        cluster.stop()
    assert lapsed == 0
    assert not reclaimed
    assert text == want


def test_a_step_stuck_past_the_step_timeout_ends_its_worker_and_its_request_completes_on_a_peer(
        greedy, tiny_model_dir, redis_url, tmp_path):
    prompt, want = greedy
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    cluster.start_gateway()
    reclaim = ["--reclaim-idle-ms", str(RECLAIM_MS)]
    cluster.start_worker("unified", "u-stuck", ["--skip-warmup", "--step-timeout", "5", *reclaim], prelude=STUCK)
    try:
        cluster.wait_ready(timeout=300)
        cluster.wait_worker("u-stuck", timeout=300)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = _ask(cluster, pool, prompt)
            _wait("the stuck worker holding the job", lambda: _holds_jobs(cluster, "u-stuck"))
            cluster.start_worker("unified", "u-peer", reclaim)  # only now: the job had to go to u-stuck
            assert cluster.procs["u-stuck"].wait(timeout=120) == STUCK_EXIT_CODE
            text = answer.result(timeout=240).choices[0].text
        assert cluster.worker("u-stuck") is None
        log = cluster.log("u-stuck")
        assert "the held step begins" in log and "the held step ends" not in log
        assert "a step has not returned in" in log and "nothing can interrupt it" in log
    finally:
        cluster.stop()
    assert text == want
