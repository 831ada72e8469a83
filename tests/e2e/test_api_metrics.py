"""vLLM's request-level series on the API port, with real processes: a gateway, a prefill and a decode
worker (tiny model, CPU) and an embedded Redis. After N requests through the openai SDK the gateway's
``/metrics`` counts N of each with the model's name, as vLLM's API server would; the workers' own
``--monitoring-port`` series count the same N once more (why the shipped dashboard and alerts pick one
side by ``job``); and the gateway's running/waiting gauges follow a request through a frozen prefill
worker and a frozen decode worker."""

import signal
import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow
MODEL = "tiny"  # TINY_ENGINE's --served-model-name
N = 5
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_url, tmp_path_factory):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path_factory.mktemp("api-metrics"))
    c.redis.flushall()
    c.metrics_ports = {"p1": free_port(), "d1": free_port()}
    c.start_gateway()
    for role, name in (("prefill", "p1"), ("decode", "d1")):
        c.start_worker(role, name, ["--monitoring-port", str(c.metrics_ports[name])])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def snapshot(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def gateway(c: Cluster) -> dict[tuple, float]:
    return snapshot(f"http://127.0.0.1:{c.port}/metrics")


def worker(c: Cluster, name: str) -> dict[tuple, float]:
    return snapshot(f"http://127.0.0.1:{c.metrics_ports[name]}/metrics")


def value(snap: dict, name: str, **labels: str) -> float:
    return snap.get((name, frozenset({"model_name": MODEL, **labels}.items())), 0.0)


def moved(after: dict, before: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def send_requests(client: openai.OpenAI) -> list:
    """N requests the ways clients send them: chat and completions, whole and streamed."""
    args = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    usages = [client.chat.completions.create(messages=chat, **args).usage,
              client.completions.create(prompt="Once upon a time", **args).usage]
    for stream in (client.chat.completions.create(messages=chat, stream=True,
                                                  stream_options={"include_usage": True}, **args),
                   client.completions.create(prompt="The quick brown fox", stream=True,
                                             stream_options={"include_usage": True}, **args),
                   client.completions.create(prompt="Hello", stream=True, stream_options={"include_usage": True},
                                             **args)):
        usages.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])
    assert len(usages) == N and all(u.completion_tokens == MAX_TOKENS for u in usages)
    return usages


def test_gateway_counts_n_requests_with_vllm_names(cluster):
    before = {"gateway": gateway(cluster), "p1": worker(cluster, "p1"), "d1": worker(cluster, "d1")}
    usages = send_requests(openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0))
    after = gateway(cluster)
    g = before["gateway"]
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert moved(after, g, f"{histogram}_count") == N, histogram
    assert moved(after, g, "vllm:time_to_first_token_seconds_sum") > 0
    assert moved(after, g, "vllm:request_success_total", finished_reason="length") == N
    prompt = sum(u.prompt_tokens for u in usages)
    assert moved(after, g, "vllm:prompt_tokens_total") == moved(after, g, "vllm:request_prompt_tokens_sum") == prompt
    assert moved(after, g, "vllm:generation_tokens_total") == N * MAX_TOKENS
    assert moved(after, g, "vllm:request_generation_tokens_sum") == N * MAX_TOKENS
    # one sample per token batch after a request's first token: at most one per token
    assert 0 < moved(after, g, "vllm:inter_token_latency_seconds_count") <= N * (MAX_TOKENS - 1)
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    # The workers count the same N requests for their part: a query over every target without a job
    # matcher would read 2N (tests/unit/test_deploy.py holds the shipped queries to one side).
    assert moved(worker(cluster, "p1"), before["p1"], "vllm:time_to_first_token_seconds_count") == N
    assert moved(worker(cluster, "d1"), before["d1"], "vllm:e2e_request_latency_seconds_count") == N


def test_running_and_waiting_follow_a_request(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    first_token = threading.Event()
    finished: list[str] = []

    def stream() -> None:
        for chunk in client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=200, stream=True,
                                               temperature=0.0, extra_body={"ignore_eos": True}):
            first_token.set()
            finished.extend(c.finish_reason for c in chunk.choices if c.finish_reason)

    def gauges() -> tuple[float, float]:
        snap = gateway(cluster)
        return value(snap, "vllm:num_requests_running"), value(snap, "vllm:num_requests_waiting")

    before = gateway(cluster)
    cluster.signal("p1", signal.SIGSTOP)  # the job stays in the Redis stream: waiting
    thread = threading.Thread(target=stream)
    try:
        thread.start()
        deadline = time.monotonic() + 10
        while gauges() != (0, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gauges() == (0, 1)
        cluster.signal("p1", signal.SIGCONT)
        assert first_token.wait(30)
        cluster.signal("d1", signal.SIGSTOP)  # mid-decode: running, for as long as the worker is frozen
        assert gauges() == (1, 0)
    finally:
        cluster.signal("p1", signal.SIGCONT)
        cluster.signal("d1", signal.SIGCONT)
        thread.join(60)
    assert finished == ["length"]
    after = gateway(cluster)
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert moved(after, before, "vllm:request_success_total", finished_reason="length") == 1
