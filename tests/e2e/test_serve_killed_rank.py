"""A rank killed with -9 while a disaggregated deployment serves a stream of greedy requests: ``kvrelay serve
--mode disaggregated`` plus a peer worker of one role whose model runs on two ranks (tensor-parallel or pipeline
stages). The peer's group goes down, the peer exits and leaves the registry, no rank outlives it, and every
request of the stream (openai SDK, several in flight) completes with the offline engine's greedy text within
its bound: a prefill peer's jobs are re-delivered to serve's prefill worker; a prompt whose KV was on its way
to a decode peer is prefilled again; a request a decode peer was decoding is queued again by the gateway, and
the client gets the rest of the same text. A worker whose rank dies while it is idle leaves too. (The peers
run with ``--step-timeout 0``: a rank that is only stopped is test_stuck_rank.py's.)"""

import concurrent.futures
import re
import threading
import time
from collections.abc import Callable

import openai
import psutil
import pytest
import redis

from kvrelay import SamplingParams
from kvrelay.shared.wire import redis_keys as keys
from tests.conftest import random_prompts
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.handoff_metrics import by_label
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REQUEST_BOUND_S = 120  # a request that takes longer than this hangs: the test fails on it
RECLAIM_MS = 2000  # a dead prefill worker's pending jobs go to a peer this soon
MAX_TOKENS = 24


def _rank(worker: psutil.Process) -> psutil.Process:
    (rank,) = [p for p in worker.children(recursive=True) if "kvrelay.shared.engine.ranks.rank_main" in p.cmdline()]
    return rank


def _holds_jobs(cluster: Cluster, worker_id: str) -> bool:
    """Whether the prefill worker has read jobs it has not ACKed (from the shared or its private stream)."""
    (instance,) = cluster.worker(worker_id).models
    held = 0
    for stream in (keys.prefill_stream(instance), keys.prefill_worker_stream(instance, worker_id)):
        try:
            held += len(cluster.redis.xpending_range(stream, keys.PREFILL_GROUP, "-", "+", 10, consumername=worker_id))
        except redis.ResponseError:  # its private stream was never created
            pass
    return held > 0


def _generated(port: int) -> float:
    """The tokens a worker has sampled (``vllm:generation_tokens`` on its /metrics), as of now: it counts a
    step's tokens before the worker sends them to the gateway."""
    return sum(by_label(port, "vllm:generation_tokens_total", "model_name").values())


def _wait(what: str, ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.05)


# when the rank dies: its worker's group hung on its first work (the rank stopped until the kill: mid-step for
# a prefill, holding handed-off KV for a decode), or a decode worker decoding a request it cannot have finished
WHEN = [("prefill", "tensor", "stopped"), ("decode", "pipeline", "stopped"), ("decode", "tensor", "decoding")]


@pytest.mark.parametrize(("role", "kind", "when"), WHEN, ids=["-".join(w) for w in WHEN])
def test_a_killed_rank_takes_its_worker_down_and_every_request_completes(role, kind, when, tiny_model_dir, tiny_offline,
                                                                         redis_url, tmp_path):
    prompts = random_prompts(16, lo=5, hi=60, seed=11)
    max_tokens = MAX_TOKENS if when == "stopped" else 180  # prompts are at most 60 tokens: 240 fit in 256
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = [tiny_offline.get_tokenizer().decode(o.outputs[0].token_ids, skip_special_tokens=True)
            for o in tiny_offline.generate([{"prompt_token_ids": p} for p in prompts], params)]
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    peer = f"{role[0]}-{kind}"
    argv = ["--mode", "disaggregated", "--model", str(tiny_model_dir), *TINY_ENGINE, "--redis-url", redis_url,
            "--reclaim-idle-ms", str(RECLAIM_MS)]
    try:
        with Served(argv, tmp_path / "serve.log") as served:
            # a decode peer with more KV blocks than serve's is the one prefill workers hand KV to first
            # (the decode worker reads no jobs: it rejects --reclaim-idle-ms)
            more = ["--num-gpu-blocks-override", "16384"] if role == "decode" else ["--reclaim-idle-ms", str(RECLAIM_MS)]
            cluster.start_worker(role, peer, [f"--{kind}-parallel-size", "2", "--step-timeout", "0",
                                              "--monitoring-port", "0", *more])
            cluster.wait_worker(peer, timeout=300)
            # an ephemeral port (a free port picked here could be taken before the worker binds it), logged
            # before the worker registers
            port = int(re.search(r"metrics on http://[^:]+:(\d+)/metrics", cluster.log(peer)).group(1))
            client = served.client(timeout=REQUEST_BOUND_S)
            rank = _rank(psutil.Process(cluster.procs[peer].pid))
            if when == "stopped":
                rank.suspend()
            first_token = threading.Event()

            def ask(prompt: list[int], on_chunk: Callable[[int], None] = lambda n: None) -> str | openai.APIError:
                text = []
                try:
                    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0.0, stream=True,
                                                           extra_body={"ignore_eos": True}):
                        first_token.set()
                        text.append(chunk.choices[0].text if chunk.choices else "")
                        on_chunk(len(text))
                except openai.APIError as exc:
                    return exc
                return "".join(text)

            def decoding_there(pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:
                """Requests one at a time until the peer, its rank stopped, holds one it cannot finish: the sole
                request it has sampled tokens for since, and too few of them (a group whose rank is stopped
                completes at most the steps already in flight). The first one is it, unless the peer took no
                part in it (prefill workers chose the other decode worker) or ran far ahead of its client."""
                asked = []
                for prompt in prompts:
                    before, second = _generated(port), threading.Event()
                    asked.append(pool.submit(ask, prompt, lambda n, second=second: n >= 2 and second.set()))
                    asked[-1].add_done_callback(lambda _, second=second: second.set())  # or it ended without one
                    _wait("a second token", second.is_set, REQUEST_BOUND_S)
                    rank.suspend()
                    if 0 < _generated(port) - before <= max_tokens // 2:
                        return asked
                    rank.resume()
                    asked[-1].result(timeout=REQUEST_BOUND_S)  # its tokens are all counted before the next
                raise AssertionError("the decode peer never held a request it could not finish")

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                if when == "decoding":
                    futures = decoding_there(pool)
                    futures += [pool.submit(ask, p) for p in prompts[len(futures):]]
                else:
                    futures = [pool.submit(ask, p) for p in prompts]
                if role == "prefill":
                    _wait("the prefill peer holding jobs", lambda: _holds_jobs(cluster, peer))
                elif when == "stopped":  # a first token is out: its KV goes to the decode worker with most room
                    _wait("a first token", first_token.is_set)
                rank.kill()
                got = [f.result(timeout=REQUEST_BOUND_S + 30) for f in futures]
            assert cluster.procs[peer].wait(timeout=60) != 0
            assert cluster.worker(peer) is None, "the dead peer is still registered"
            assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
            assert (f"{kind}-parallel rank 1 of 2 (pid {rank.pid}) was killed by signal 9; the group is down"
                    in cluster.log(peer))
            assert ask(prompts[0]) == want[0]  # serve's own worker of that role takes everything from here on
    finally:
        cluster.stop()
    for i, (text, expected) in enumerate(zip(got, want, strict=True)):
        assert text == expected, (i, text)
    if when == "decoding":
        assert "job(s) queued again" in served.log.read_text(errors="replace")


def test_a_rank_killed_while_its_worker_is_idle_takes_the_worker_down(tiny_model_dir, redis_url, tmp_path):
    """Nothing to step: the worker still sees its group go down, and leaves the registry rather than stay
    there for prefill workers to hand KV to until its next step fails."""
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    try:
        cluster.start_worker("decode", "d-idle", ["--tensor-parallel-size", "2"])
        cluster.wait_worker("d-idle", timeout=300)
        rank = _rank(psutil.Process(cluster.procs["d-idle"].pid))
        rank.kill()
        assert cluster.procs["d-idle"].wait(timeout=60) != 0
        assert cluster.worker("d-idle") is None
    finally:
        cluster.stop()
    assert f"tensor-parallel rank 1 of 2 (pid {rank.pid}) was killed by signal 9" in cluster.log("d-idle")
