"""Overload queues, with real processes (gateway, prefill and decode worker, embedded Redis, the tiny
model on the CPU) driven by the ``openai`` SDK: more concurrent requests than decode seats, and ``n`` up
to 128, all complete. Prefilled requests that find the decode batch full wait for a seat (bounded by
their deadline; ``kvrelay_handoff_seat_wait_seconds`` on the prefill worker counts them); none fails for
a full batch or an expired grant."""

import asyncio
import subprocess
import sys
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.openai_stream import streamed_tokens_and_finish

pytestmark = pytest.mark.slow
MODEL = "tiny"  # TINY_ENGINE's --served-model-name
CLIENT_TIMEOUT_S = 180  # far above any legitimate answer here: hitting it means something hung


@pytest.fixture()
def cluster(tiny_model_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    c.redis.flushall()
    c.start_gateway()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def short_grants(tiny_model_dir, tmp_path_factory):
    """A gateway, p1, and d1 of 16 seats whose grants lapse after 0.3 s, started once for both prompt lengths
    (starting the three is most of such a test's time), on a Redis of their own: ``cluster`` flushes the
    session's between tests."""
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_model_dir), TINY_ENGINE, tmp_path_factory.mktemp("short-grants"))
        c.start_gateway()
        c.start_worker("prefill", "p1")
        c.start_worker("decode", "d1", ["--max-num-seqs", "16", "--handoff-timeout", "0.3"])
        try:
            c.wait_ready()
            yield c
        finally:
            c.stop()


def _client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.base_url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)


async def _n_choices(client: openai.AsyncOpenAI, n: int, prompt) -> list[tuple[int, str]]:
    resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=n,
                                           extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2 * n
    return sorted((c.index, c.finish_reason) for c in resp.choices)


def _prefill_metric(port: int, name: str, sample: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == sample)
    return 0.0


@pytest.mark.parametrize("prompt_len", [5, 60])
def test_n_64_and_128_complete_when_a_prefill_step_outlasts_the_grant_ttl(short_grants, prompt_len):
    """The decode side's grant TTL (its --handoff-timeout) is shorter here than one prefill step of 128
    prompts, as a 10 s TTL is on a CPU prefilling thousands of SmolLM2 tokens at once: grants were read
    after they had lapsed, and a whole n=128 request failed with 500 "no grant for this request"."""
    cluster = short_grants
    prompt = list(range(5, 5 + prompt_len))

    async def run():
        client = _client(cluster)
        out = []
        for _ in range(2):
            out += await asyncio.gather(*(_n_choices(client, n, prompt) for n in (64, 128, 128)))
        return out

    for choices, n in zip(asyncio.run(run()), [64, 128, 128] * 2, strict=True):
        assert choices == [(i, "length") for i in range(n)]


def test_four_times_more_streams_than_decode_seats_all_complete(cluster):
    """16 concurrent streams on 4 decode seats, then n=64: every one completes with every token; the
    prefilled requests that waited for a seat are counted on the prefill worker."""
    port = free_port()
    cluster.start_worker("prefill", "p1", ["--monitoring-port", str(port)])
    cluster.start_worker("decode", "d1", ["--max-num-seqs", "4"])
    cluster.wait_ready()

    waiting_seen: list[float] = []

    async def watch_waiting() -> None:  # the live gauge, while the streams run
        while True:
            waiting_seen.append(await asyncio.to_thread(
                _prefill_metric, port, "kvrelay_handoff_waiting_for_seat", "kvrelay_handoff_waiting_for_seat"))
            await asyncio.sleep(0.05)

    async def run():
        client = _client(cluster)
        watcher = asyncio.create_task(watch_waiting())
        streams = await asyncio.gather(*(streamed_tokens_and_finish(client, MODEL, [5 + i, 6, 7, 8], 64)
                                         for i in range(16)))
        watcher.cancel()
        return streams, await _n_choices(client, 64, "Once upon a time")

    streams, choices = asyncio.run(run())
    assert streams == [(64, "length")] * 16
    assert choices == [(i, "length") for i in range(64)]
    # 16 on 4 seats: some prefilled requests waited, were seen waiting, and were counted once done
    assert max(waiting_seen) > 0
    assert _prefill_metric(port, "kvrelay_handoff_seat_wait_seconds", "kvrelay_handoff_seat_wait_seconds_count") > 0
    assert _prefill_metric(port, "kvrelay_handoff_waiting_for_seat", "kvrelay_handoff_waiting_for_seat") == 0


def test_overload_benchmark_runs_both_loads_and_every_request_completes():
    """``python -m kvrelay.bench.overload`` at a toy size, as its own process (benchmarks and tests never
    import each other): both rows printed, every request of each completed."""
    proc = subprocess.run([sys.executable, "-m", "kvrelay.bench.overload", "--seats", "2", "--factor", "2",
                           "--requests", "8", "--output-len", "8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith(("| no overload", "| 2x"))]
    assert [(r[1], r[2]) for r in rows] == [("2", "8/8"), ("4", "8/8")], proc.stdout
