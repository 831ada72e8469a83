"""Demand-aware eviction (shared/worker/eviction.py) with real worker processes, Redis, HTTP and the openai SDK:
one prefill and one decode worker with room for two of three models, steady traffic to two of them, then a
queue for the third. The third's load evicts the busy model in lower demand (not the hot one): drained, not
dropped, so each of its requests completes; its next requests wait for its reload, which happens once the
third's queue is served, and are answered; the hot model serves throughout."""

import threading
import time

import openai
import pytest

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from tests.e2e.jobs import JobClient
from tests.e2e.model_variants import PROMPT, variant
from tests.e2e.test_multi_model import cluster, start  # noqa: F401  (the fixture and the cluster setup)

pytestmark = pytest.mark.slow

WAIT_S = 150  # generous: loads and drains on a busy 2-core CI box
LONG = 160  # tokens per request of the busy low-demand model: it is always running something
TAIL_PAUSE = 0.5
RESIDENCY_S = 2.0  # the workers' --min-residency-s: tail is past it once its traffic has run a while
COLD_JOBS = 48  # as a rate (eviction.py: each an arrival just now) ~3.3 requests a second, above tail's 2 at most


def _traffic(client: openai.OpenAI, model: str, max_tokens: int, pause: float, stop: threading.Event, done: list,
             errors: list):
    while not stop.wait(pause):
        try:
            got = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert got.usage.completion_tokens == max_tokens, got
            done.append(time.monotonic())
        except Exception as exc:  # every failure is the test's
            errors.append(f"{model}: {exc!r}")


def test_a_queue_for_a_cold_model_evicts_the_busy_model_in_lower_demand_and_loses_none_of_its_requests(
        cluster, tmp_path, tiny_model_dir):  # noqa: F811
    repo = ModelRepository(tmp_path / "repo")
    for name, seed in (("hot", 0), ("tail", 1), ("cold", 2)):
        import_model(repo, str(variant(tiny_model_dir, tmp_path / name, seed)), name, progress=False)
    weights = sum(f.stat().st_size for f in (tmp_path / "hot").glob("*.safetensors"))
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}}}
models:
  - {{name: hot, version: 1, precision: float32}}
  - {{name: tail, version: 1, precision: float32}}
  - {{name: cold, version: 1, precision: float32, load: lazy}}
""")
    client = start(cluster, repo, cfg, extra=["--weights-memory", str(int(weights * 2.5)),  # two of three
                                              "--min-residency-s", str(RESIDENCY_S)])
    client = client.with_options(timeout=WAIT_S)
    stop, errors = threading.Event(), []
    done = {"hot": [], "tail": []}
    # tail: a long request at a time, a pause (shorter than the worker's idle grace) between: always busy, at
    # most 1/TAIL_PAUSE requests a second however fast the box, below the cold queue's demand
    threads = [threading.Thread(target=_traffic, args=(client, m, n, pause, stop, done[m], errors), daemon=True)
               for m, n, pause in (("hot", 8, 0.0), ("hot", 8, 0.0), ("tail", LONG, TAIL_PAUSE))]
    for t in threads:
        t.start()
    jobs = JobClient(cluster.redis, "cold@1")
    try:
        time.sleep(3 * RESIDENCY_S)  # past tail's minimum residency; both demands now read their traffic
        assert not errors, errors
        ids = [f"cold-{i}" for i in range(COLD_JOBS)]
        for rid in ids:  # a queue no worker reads: the gateway's prewarm loads it, with this demand
            jobs.submit(rid, PROMPT, max_tokens=8)
        seen = jobs.wait(ids, timeout=WAIT_S)
        assert all(s.finish_reason == "length" and len(s.tokens) == 8 for s in seen)
        log = cluster.log("p1")
        # the low-demand model goes, the hot one stays. Usually tail is mid-request (the busy path, drained first);
        # on a loaded box its client thread can leave it without a request for over the idle grace, and then it
        # goes as idle: the same choice by the same demand rule (the busy path's own checks: test_eviction_policy.py
        # and the drain tests in tests/unit/test_model_host.py). Only the evictions made room for cold count: once
        # cold's queue is served, tail's reload may evict whichever model its clients left idle on a loaded box
        # shared/worker/load_room.py's lines: "... to make room for cold@1" (idle), "... for cold@1 (0.50 req/s, ..." (busy)
        for_cold = [line for line in log.splitlines()
                    if "evicting " in line and (line.endswith(" to make room for cold@1") or " for cold@1 (" in line)]
        assert any("evicting tail@1 (busy" in line or "evicting tail@1 (idle" in line for line in for_cold), log[-3000:]
        assert not any("evicting hot@1" in line for line in for_cold), log[-3000:]
        tail_before = len(done["tail"])
        deadline = time.monotonic() + WAIT_S
        while len(done["tail"]) < tail_before + 2:  # reloaded once cold's queue was served: serving again
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.2)
    finally:
        stop.set()
        jobs.close()
        for t in threads:
            t.join(WAIT_S)
    assert not errors, errors  # no request of any model failed or timed out, tail's across its eviction included
    assert len(done["hot"]) > 10
