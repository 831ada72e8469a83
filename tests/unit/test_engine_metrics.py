"""The gateway's relay of the workers' engine series (gateway/engine_metrics.py), from WorkerInfo records as
the heartbeat carries them (through the codec): one series per (model name, engine), vLLM's bucket bounds
read off a worker's finer histogram, and two versions of one model on one worker (mid-swap) merged into
one series set rather than repeated (a scrape with a repeated series is refused by Prometheus)."""

import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.gateway.engine_metrics import EngineMetrics
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.engine_stats import REQUEST_LATENCY_BUCKETS, EngineStats, HistogramCounts
from kvrelay.shared.wire.protocol import InstanceStatus, WorkerInfo

FINER = (0.05, 0.1, 0.3, 0.4, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
         240.0, 480.0, 960.0, 1920.0, 7680.0, math.inf)


def stats(usage: float, queries: int, observed: list[float]) -> EngineStats:
    counts = [sum(v <= b for v in observed) for b in FINER]
    queue = HistogramCounts(name="vllm:request_queue_time_seconds", bounds=list(FINER), counts=counts,
                            sum=sum(observed))
    return EngineStats(kv_cache_usage=usage, prefix_cache_queries=queries, prefix_cache_hits=1, preemptions=2,
                       block_size=16, num_gpu_blocks=100, cache_dtype="bfloat16", enable_prefix_caching=True,
                       histograms=[queue])


def worker(worker_id: str, *instances: tuple[str, str, EngineStats]) -> WorkerInfo:
    info = WorkerInfo(worker_id=worker_id, role="unified", models=[i for i, _, _ in instances], zmq_addr="tcp://x:1",
                      free_blocks=0, total_blocks=0, running=0, waiting=0, pid=1, host="h", started=0.0,
                      heartbeat=0.0, instances=[InstanceStatus(instance=i, name=n, version=0, state="ready", engine=e)
                                                for i, n, e in instances])
    return decode(encode(info), WorkerInfo)  # as the gateway reads it from Redis


def scrape(workers: list[WorkerInfo]) -> dict:
    registry = CollectorRegistry()
    relay = EngineMetrics()
    registry.register(relay)
    relay.workers = workers
    text = generate_latest(registry).decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    keys = [(s.name, frozenset(s.labels.items())) for s in samples]
    assert len(keys) == len(set(keys)), "a series repeated"
    return {k: s.value for k, s in zip(keys, samples, strict=True)}


def at(snap: dict, name: str, **labels: str) -> float:
    return snap[(name, frozenset(labels.items()))]


def test_one_series_set_per_engine_with_vllms_bounds():
    snap = scrape([worker("w1", ("main@1", "main", stats(0.25, 10, [0.05, 0.35, 3.0]))),
                   worker("w2", ("main@1", "main", stats(0.5, 7, [100.0])))])
    assert at(snap, "vllm:kv_cache_usage_perc", model_name="main", engine="w1") == 0.25
    assert at(snap, "vllm:gpu_cache_usage_perc", model_name="main", engine="w2") == 0.5
    assert at(snap, "vllm:prefix_cache_queries_total", model_name="main", engine="w1") == 10
    les = {float(le) for (name, labels) in snap if name == "vllm:request_queue_time_seconds_bucket"
           for key, le in labels if key == "le"}
    assert les == {*REQUEST_LATENCY_BUCKETS, math.inf}
    w1 = {"model_name": "main", "engine": "w1"}
    assert at(snap, "vllm:request_queue_time_seconds_bucket", le="0.3", **w1) == 1  # 0.05 (0.35 is above)
    assert at(snap, "vllm:request_queue_time_seconds_bucket", le="0.5", **w1) == 2
    assert at(snap, "vllm:request_queue_time_seconds_bucket", le="+Inf", **w1) == 3
    assert at(snap, "vllm:request_queue_time_seconds_count", **w1) == 3
    assert at(snap, "vllm:cache_config_info", block_size="16", cache_dtype="bfloat16", enable_prefix_caching="True",
              num_gpu_blocks="100", **w1) == 1


def test_two_versions_of_a_model_on_one_worker_make_one_series_set():
    snap = scrape([worker("w1", ("main@1", "main", stats(0.25, 10, [0.4])), ("main@2", "main", stats(0.75, 5, [9.0])))])
    w1 = {"model_name": "main", "engine": "w1"}
    assert at(snap, "vllm:kv_cache_usage_perc", **w1) == 0.75
    assert at(snap, "vllm:prefix_cache_queries_total", **w1) == 15
    assert at(snap, "vllm:num_preemptions_total", **w1) == 4
    assert at(snap, "vllm:request_queue_time_seconds_count", **w1) == 2
    assert at(snap, "vllm:request_queue_time_seconds_bucket", le="0.5", **w1) == 1
    assert at(snap, "vllm:request_queue_time_seconds_sum", **w1) == 9.4
