"""A rank stopped with SIGSTOP (it hangs rather than dies) under a unified worker serving a request: the worker's
step waits in a collective that never completes. Once the step has waited ``--step-timeout`` (short here; the
default bounds a legitimate step, far longer), the worker takes its group down as when a rank dies: it logs which
rank is stopped, kills the ranks, leaves the registry and exits non-zero; and the request, whose job it never
finished, completes on a peer with the offline engine's greedy text."""

import concurrent.futures

import openai
import psutil
import pytest

from kvrelay import SamplingParams
from tests.conftest import random_prompts
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.test_serve_killed_rank import RECLAIM_MS, _holds_jobs, _rank, _wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MAX_TOKENS = 16


def test_a_stopped_rank_takes_its_worker_down_and_its_request_completes_on_a_peer(tiny_model_dir, tiny_offline,
                                                                                   redis_url, tmp_path):
    (prompt,) = random_prompts(1, lo=5, hi=30, seed=5)
    (out,) = tiny_offline.generate({"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    want = tiny_offline.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    cluster.start_gateway()
    reclaim = ["--reclaim-idle-ms", str(RECLAIM_MS)]
    cluster.start_worker("unified", "u-stuck", ["--tensor-parallel-size", "2", "--step-timeout", "5", *reclaim])
    try:
        cluster.wait_ready(timeout=300)
        cluster.wait_worker("u-stuck", timeout=300)
        rank = _rank(psutil.Process(cluster.procs["u-stuck"].pid))
        rank.suspend()
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=240)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"ignore_eos": True})
            _wait("the stopped worker holding the job", lambda: _holds_jobs(cluster, "u-stuck"))
            cluster.start_worker("unified", "u-peer", reclaim)  # only now: the job had to go to u-stuck
            assert cluster.procs["u-stuck"].wait(timeout=120) != 0
            text = answer.result(timeout=240).choices[0].text
        assert cluster.worker("u-stuck") is None
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
        log = cluster.log("u-stuck")
        assert "tensor-parallel group of 2 is stuck: a step has waited" in log
        assert f"rank 1 (pid {rank.pid}) is stopped; the group is down" in log
    finally:
        cluster.stop()
    assert text == want
