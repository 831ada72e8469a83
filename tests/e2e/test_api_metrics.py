"""vLLM's request-level series on the API port, with real processes: a gateway, a prefill and a decode
worker (tiny model, CPU) and an embedded Redis. After N requests through the openai SDK the gateway's
``/metrics`` counts N of each with the model's name, as vLLM's API server would; the workers' own
``--monitoring-port`` series count the same N once more (why the shipped dashboard and alerts pick one
side by ``job``); and the gateway's running/waiting gauges follow a request through a frozen prefill
worker and a frozen decode worker. vLLM V1's engine series reach the gateway's ``/metrics`` through the
workers' heartbeats (per engine, with vLLM's types, labels and bucket bounds, equal to the workers' own
and moving with requests), beside the request parameters the gateway counts; and the shipped vLLM
dashboard queries only series a real gateway serves."""

import json
import math
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.unit.test_deploy import _names_in, exposed_names

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


# vLLM V1's engine series, relayed from the workers' heartbeats, and its request-parameter histograms,
# with vLLM's types, labels and bucket bounds (vllm/v1/metrics/loggers.py)
LATENCY_LE = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
              960.0, 1920.0, 7680.0, math.inf}
ENGINE_SERIES = {
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:iteration_tokens_total": ("histogram", {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                  math.inf}),
    "vllm:request_queue_time_seconds": ("histogram", LATENCY_LE),
    "vllm:request_inference_time_seconds": ("histogram", LATENCY_LE),
    "vllm:request_prefill_time_seconds": ("histogram", LATENCY_LE),
    "vllm:request_decode_time_seconds": ("histogram", LATENCY_LE),
}
PHASES = ("queue", "prefill", "decode", "inference")
# what vLLM's own Grafana dashboard (examples/online_serving/prometheus_grafana in vLLM's repository)
# queries, all with a model_name matcher alone: pointed at the gateway's job it finds every one
VLLM_DASHBOARD = {"vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
                  "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
                  "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
                  "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
                  "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                  "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
                  "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                  "vllm:request_max_num_generation_tokens_sum"}


def families(c: Cluster) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{c.port}/metrics", timeout=10) as resp:
        return {fam.name: fam for fam in text_string_to_metric_families(resp.read().decode())}


def engine_total(snap: dict, name: str) -> float:
    """``name`` summed over the engines (workers) serving MODEL."""
    return sum(v for (n, labels), v in snap.items() if n == name and ("model_name", MODEL) in labels)


def test_engine_series_have_vllms_types_labels_and_buckets(cluster):
    fams = families(cluster)
    for name, (kind, bounds) in ENGINE_SERIES.items():
        fam = fams[name]
        assert fam.type == kind, name
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        assert {s.labels["engine"] for s in samples} == {"p1", "d1"}, name
        assert {s.labels["model_name"] for s in samples} == {MODEL}, name
        if bounds is not None:
            for engine in ("p1", "d1"):
                les = {float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")
                       and s.labels["engine"] == engine}
                assert les == bounds, (name, engine)
        else:
            assert {frozenset(s.labels) for s in samples} == {frozenset({"model_name", "engine"})}, name
    assert all(0.0 <= s.value <= 1.0 for s in fams["vllm:kv_cache_usage_perc"].samples)
    info = fams["vllm:cache_config_info"]
    assert info.type == "gauge" and {s.labels["engine"] for s in info.samples} == {"p1", "d1"}
    for s in info.samples:
        assert s.value == 1 and int(s.labels["block_size"]) > 0 and int(s.labels["num_gpu_blocks"]) > 0
        assert s.labels["enable_prefix_caching"] in ("True", "False") and s.labels["cache_dtype"]
    assert fams["vllm:request_params_n"].type == fams["vllm:request_params_max_tokens"].type == "histogram"
    n_les = {float(s.labels["le"]) for s in fams["vllm:request_params_n"].samples if s.name.endswith("_bucket")}
    assert not n_les or n_les == {1, 2, 5, 10, 20, math.inf}


def settled(c: Cluster) -> dict:
    """The gateway's scrape once the engine series it relays match each worker's own ``--monitoring-port``
    (the heartbeat that carries them comes every couple of seconds)."""
    relayed = [f"vllm:request_{p}_time_seconds_count" for p in PHASES] + ["vllm:iteration_tokens_total_count"]
    deadline = time.monotonic() + 60
    while True:
        snap, own = gateway(c), {name: worker(c, name) for name in ("p1", "d1")}
        if all(value(snap, n, engine=e) == value(own[e], n) for n in relayed for e in own):
            return snap
        assert time.monotonic() < deadline, "the gateway's engine series never caught up with the workers'"
        time.sleep(0.5)


def test_engine_series_move_when_requests_run(cluster):
    before = settled(cluster)
    usages = send_requests(openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0))
    # n=2: one prompt, one n sample of 2 and two max_tokens samples
    two = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0).completions.create(
        model=MODEL, prompt="Two ways", n=2, max_tokens=MAX_TOKENS, temperature=1.0, extra_body={"ignore_eos": True})
    assert len(two.choices) == 2
    requests = N + 2
    after = settled(cluster)
    counts = {p: engine_total(after, f"vllm:request_{p}_time_seconds_count")
              - engine_total(before, f"vllm:request_{p}_time_seconds_count") for p in PHASES}
    # prefill worker: queue and prefill time; decode worker: decode and inference time, once per request
    assert counts == {p: requests for p in PHASES}
    for p, engine in (("queue", "p1"), ("prefill", "p1"), ("decode", "d1"), ("inference", "d1")):
        assert moved(after, before, f"vllm:request_{p}_time_seconds_count", engine=engine) == requests
    assert engine_total(after, "vllm:request_decode_time_seconds_sum") > engine_total(
        before, "vllm:request_decode_time_seconds_sum")
    steps = engine_total(after, "vllm:iteration_tokens_total_count") - engine_total(
        before, "vllm:iteration_tokens_total_count")
    computed = engine_total(after, "vllm:iteration_tokens_total_sum") - engine_total(
        before, "vllm:iteration_tokens_total_sum")
    prompt = sum(u.prompt_tokens for u in usages) + two.usage.prompt_tokens
    queried, hits = (engine_total(after, f"vllm:prefix_cache_{k}_total") - engine_total(
        before, f"vllm:prefix_cache_{k}_total") for k in ("queries", "hits"))
    # every prompt token was computed in some step or found in the prefix cache; decode steps add one each
    assert steps > 0 and computed + hits >= prompt + requests * (MAX_TOKENS - 1)
    assert queried >= prompt - two.usage.prompt_tokens  # the second choice of n=2 may share the first's lookup
    assert engine_total(after, "vllm:prefix_cache_hits_total") <= engine_total(after, "vllm:prefix_cache_queries_total")
    # request parameters, counted by the gateway as vLLM counts them
    assert moved(after, before, "vllm:request_params_n_count") == N + 1
    assert moved(after, before, "vllm:request_params_n_bucket", le="1.0") == N
    assert moved(after, before, "vllm:request_params_n_sum") == N + 2
    assert moved(after, before, "vllm:request_params_max_tokens_count") == requests
    assert moved(after, before, "vllm:request_params_max_tokens_sum") == requests * MAX_TOKENS
    assert moved(after, before, "vllm:request_params_max_tokens_bucket", le="5.0") == 0
    assert moved(after, before, "vllm:request_params_max_tokens_bucket", le="10.0") == requests
    # per prompt: the n=2 request's two choices make one sample
    assert moved(after, before, "vllm:request_max_num_generation_tokens_count") == N + 1
    assert moved(after, before, "vllm:request_max_num_generation_tokens_sum") == (N + 1) * MAX_TOKENS
    assert moved(after, before, "vllm:time_per_output_token_seconds_count") == moved(
        after, before, "vllm:inter_token_latency_seconds_count") > 0
    assert engine_total(after, "vllm:gpu_cache_usage_perc") == engine_total(after, "vllm:kv_cache_usage_perc")


def test_vllm_dashboard_queries_only_series_the_gateway_serves(cluster):
    """deploy/grafana/vllm-dashboard.json parses, and every metric its queries name is on a real
    gateway's /metrics (with workers behind it), read from the gateway's job only."""
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "vllm-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/metrics", timeout=10) as resp:
        exposed = exposed_names(resp.read().decode())
    referenced = set().union(*(_names_in(e) for e in exprs))
    assert not referenced - exposed, sorted(referenced - exposed)
    assert not VLLM_DASHBOARD - exposed, sorted(VLLM_DASHBOARD - exposed)
    wanted = {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
              "vllm:num_preemptions_total", "vllm:iteration_tokens_total_bucket", "vllm:cache_config_info",
              "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket",
              *(f"vllm:request_{p}_time_seconds_sum" for p in PHASES)}
    assert wanted <= referenced, sorted(wanted - referenced)
    for expr in exprs:  # the workers serve the same names for their part: only the gateway's job is read
        for name in _names_in(expr):
            for matchers in re.findall(rf"{re.escape(name)}(\{{[^}}]*\}})?", expr):
                assert 'job="$job"' in matchers, expr
    job = next(v for v in dash["templating"]["list"] if v["name"] == "job")
    assert job["query"] == "kvrelay-gateway"

