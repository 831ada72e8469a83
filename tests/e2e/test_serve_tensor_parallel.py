"""``kvrelay serve --mode unified --tensor-parallel-size 2`` (or ``--pipeline-parallel-size 2``): the unified
worker runs its model as two rank processes and answers as one process does; a rank killed with -9 takes its
worker down with a clear error, the supervisor restarts the worker, the request is answered after all, and no rank outlives serve.
Disaggregated, a prefill and a decode worker of different tensor- or pipeline-parallel sizes hand KV off to each
other."""

import contextlib
from collections.abc import Iterator

import openai
import psutil
import pytest

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.handoff_metrics import handoffs_settled
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "The capital of France is"
RECLAIM_MS = 2000  # the killed worker's pending job goes to its restarted self this soon (default 15 s)


def _ranks(serve: psutil.Process) -> list[psutil.Process]:
    return [p for p in serve.children(recursive=True) if "kvrelay.shared.engine.ranks.rank_main" in p.cmdline()]


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_unified_answers_like_one_process_and_survives_a_killed_rank(kind, tiny_model_dir, tiny_offline, tmp_path):
    """Size 2 either way: the worker's second process is a rank (tensor) or a stage (pipeline)."""
    want = tiny_offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    argv = ["--mode", "unified", "--model", str(tiny_model_dir), *TINY_ENGINE, f"--{kind}-parallel-size", "2",
            "--reclaim-idle-ms", str(RECLAIM_MS)]
    with Served(argv, tmp_path / "serve.log") as served:
        client = served.client()

        def ask() -> str:
            return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                             temperature=0.0).choices[0].text

        assert ask() == want
        serve = psutil.Process(served.proc.pid)
        (rank,) = _ranks(serve)
        rank.kill()
        assert ask() == want  # re-delivered to the restarted worker
        log = served.log.read_text(errors="replace")
        assert f"{kind}-parallel rank 1 of 2 (pid {rank.pid}) was killed by signal 9; the group is down" in log
        survivors = _ranks(serve)
        assert len(survivors) == 1 and survivors[0].pid != rank.pid
    gone, alive = psutil.wait_procs(survivors, timeout=30)
    assert not alive


def _one_process_texts(llm: LLM, prompts: list[list[int]]) -> list[str]:
    """The offline engine's greedy text of each prompt, in one process."""
    return [llm.get_tokenizer().decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=12))]


@contextlib.contextmanager
def _disaggregated(redis_url, model_dir, tmp_path, prefill_args: list[str], decode_args: list[str]
                   ) -> Iterator[Cluster]:
    """A gateway, prefill worker p1 and decode worker d1 (each with its own flags), ready; stopped on leaving."""
    cluster = Cluster(redis_url, str(model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    try:
        cluster.start_gateway()
        cluster.start_worker("prefill", "p1", prefill_args)
        cluster.start_worker("decode", "d1", decode_args)
        cluster.wait_ready(timeout=300)
        yield cluster
    finally:
        cluster.stop()


def _served_texts(cluster: Cluster, prompts: list[list[int]]) -> list[str]:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=120)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0.0).choices[0].text
            for p in prompts]


@pytest.mark.parametrize(("kind", "prefill_size", "decode_size"),
                         [("tensor", 2, 1), ("tensor", 1, 2), ("pipeline", 2, 1), ("pipeline", 1, 2)])
def test_disaggregated_handoff_across_parallel_layouts(kind, prefill_size, decode_size, tiny_model_dir, tiny_offline,
                                                      redis_url, tmp_path):
    """Gateway -> prefill worker -> KV handoff over ZMQ frames -> decode worker, the two of different tensor-
    or pipeline-parallel sizes on the tiny llama (2 KV heads: one per rank at TP 2; 2 layers: one per stage at
    PP 2): each prefill rank sends its own heads or layers (the "rank_layers" transport, counted by the prefill
    worker's kvrelay_handoffs_total), placed by head and layer on the decode side; a one-rank prefill worker
    sends each decode rank its share the same way; and the greedy text is the offline engine's in one process."""
    prompts = random_prompts(3, lo=5, hi=60, seed=7)
    want = _one_process_texts(tiny_offline, prompts)
    metrics = free_port()
    with _disaggregated(redis_url, tiny_model_dir, tmp_path, [f"--{kind}-parallel-size", str(prefill_size),
                                                             "--monitoring-port", str(metrics)],
                        [f"--{kind}-parallel-size", str(decode_size)]) as cluster:
        got = _served_texts(cluster, prompts)
        counted = handoffs_settled(metrics, "transport", len(prompts))
    assert got == want
    assert counted == {"rank_layers": len(prompts)}, counted
    for worker in ("p1", "d1"):  # stopped, each worker stops its ranks: none dies under it
        assert "the group is down" not in cluster.log(worker)


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_a_decode_group_scheduling_asynchronously_answers_like_one_process(kind, tiny_model_dir, tiny_offline,
                                                                           redis_url, tmp_path):
    """A decode worker of two ranks (or stages) with --async-scheduling behind a one-process prefill worker: each
    rank takes its share of the handed-off KV, and rank 0 feeds every rank the ids it sampled a step ago from its
    device; the greedy text is the offline engine's in one process."""
    prompts = random_prompts(4, lo=5, hi=60, seed=9)
    want = _one_process_texts(tiny_offline, prompts)
    with _disaggregated(redis_url, tiny_model_dir, tmp_path, [],
                        [f"--{kind}-parallel-size", "2", "--async-scheduling"]) as cluster:
        got = _served_texts(cluster, prompts)
    assert got == want
    assert "the group is down" not in cluster.log("d1")
