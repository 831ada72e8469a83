"""Prefix-affinity routing with real processes: two prefill workers, one decode worker, a gateway.
Prompts sharing a prefix land on the worker that cached it, so every repeat reports cached prompt
tokens (caches are per worker: a repeat landing on the other worker would report none); and jobs routed
to a prefill worker that was killed are adopted by its peer and still answered."""

import random
import threading
import time
import urllib.request

import openai
import pytest

from kvrelay.gateway.control.routing import Policy, route
from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE, TINY_VOCAB

pytestmark = pytest.mark.slow
PREFIX = 64  # tokens: 8 blocks of 8 (TINY_ENGINE's --block-size)
BLOCK = 8
GATEWAY = ["--affinity-prefix-tokens", str(PREFIX), "--enable-prompt-tokens-details"]


@pytest.fixture()
def cluster(tiny_model_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    c.redis.flushall()
    c.start_gateway(extra=GATEWAY)
    yield c
    c.stop()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, TINY_VOCAB) for _ in range(n)]


def routed_to(c: Cluster, prompt: list[int]) -> str:
    """Where the gateway's router sends ``prompt`` with both prefill workers idle (the same function,
    over the workers' own heartbeat records)."""
    workers = [c.worker("p1"), c.worker("p2")]
    model = workers[0].models[0]
    worker = route(prompt, model, BLOCK, "default", None, workers, {}, Policy(prefix_tokens=PREFIX))
    assert worker is not None
    return worker


def prompt_tokens_metric(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def complete(c: Cluster, prompt: list[int]) -> openai.types.Completion:
    client = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0, timeout=90)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0)


def test_requests_sharing_a_prefix_meet_its_cache(cluster):
    ports = {}
    for name in ("p1", "p2"):
        ports[name] = free_port()
        cluster.start_worker("prefill", name, extra=["--monitoring-port", str(ports[name])])
    cluster.start_worker("decode", "d1")
    cluster.wait_ready()
    prefixes = [tokens(seed, PREFIX) for seed in range(6)]
    assert {routed_to(cluster, p) for p in prefixes} == {"p1", "p2"}  # the fixed data covers both workers
    for i, prefix in enumerate(prefixes):
        first = complete(cluster, prefix + tokens(1000 + i, 12))
        repeat = complete(cluster, prefix + tokens(2000 + i, 12))
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # the whole shared prefix, found on the worker that computed it
        assert repeat.usage.prompt_tokens_details.cached_tokens >= PREFIX, f"prefix {i}"
    assert all(prompt_tokens_metric(port) > 0 for port in ports.values())  # both workers prefilled


def test_jobs_routed_to_a_killed_prefill_worker_are_answered(cluster):
    cluster.start_worker("prefill", "p1")
    cluster.start_worker("prefill", "p2")
    cluster.start_worker("decode", "d1")
    cluster.wait_ready()
    prompts = [p for p in (tokens(seed, PREFIX + 8) for seed in range(40)) if routed_to(cluster, p) == "p1"][:4]
    assert len(prompts) == 4
    cluster.kill("p1")  # its heartbeat outlives it by up to HEARTBEAT_TTL_S: the gateway still routes there
    results: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            results[i] = complete(cluster, prompts[i])
        except Exception as exc:  # the assertion below names it
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    private = keys.prefill_worker_stream(cluster.worker("p2").models[0], "p1")
    seen = 0
    deadline = time.monotonic() + 30  # or until p1's heartbeat key expires, whichever comes first
    while seen == 0 and time.monotonic() < deadline and cluster.redis.exists(keys.worker_key("p1")):
        seen = cluster.redis.xlen(private)
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert seen > 0, "nothing was routed to the killed worker's stream: the test did not test adoption"
    for i in range(len(prompts)):
        out = results.get(i)
        assert isinstance(out, openai.types.Completion), f"request {i}: {out!r}"
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert cluster.redis.xlen(private) == 0
