"""vLLM's engine-level series on the gateway's ``/metrics``, from the workers' heartbeats: vLLM serves
them on its API port, so a dashboard built for vLLM reads KV usage, prefix-cache hits, preemptions,
tokens per step and the per-request phase times (queue, prefill, decode, inference) from there.

Each worker's heartbeat carries a snapshot of its engines (``InstanceStatus.engine``,
shared/wire/engine_stats.py); ``/metrics`` renews the view of the live workers first (probes.py) and
this collector writes one series per engine with vLLM's labels: ``model_name`` (the served name, as
the gateway's request series use) and ``engine`` (the worker id: each worker runs its own engine, as
each of vLLM's data-parallel engines has its index). Values are as of that worker's last heartbeat
(``HEARTBEAT_INTERVAL_S``); a worker that died leaves with its series. Every gateway relays the same
engines, so across gateways take one gateway's (or ``max by (model_name, engine)``), never a sum.
"""

import math

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvrelay.shared.wire.engine_stats import RELAYED_HISTOGRAMS, EngineStats
from kvrelay.shared.wire.protocol import WorkerInfo

_LABELS = ["model_name", "engine"]
_CACHE_INFO = ["block_size", "cache_dtype", "enable_prefix_caching", "engine", "model_name", "num_gpu_blocks"]
_DOCS = {
    "vllm:iteration_tokens_total": "Tokens per engine step (vLLM's count: prompts whose first token came, tokens generated)",
    "vllm:request_queue_time_seconds": "Time requests waited before their first scheduling (Redis queue included)",
    "vllm:request_inference_time_seconds": "Time requests ran on an engine: first scheduling to last token",
    "vllm:request_prefill_time_seconds": "Time from a request's first scheduling to its first token",
    "vllm:request_decode_time_seconds": "Time from a request's first token to its last",
}


def _bound(value: float) -> str:
    return "+Inf" if value == math.inf else repr(float(value))


class EngineMetrics:
    """A prometheus collector over the last snapshot of the live workers; probes.py renews ``workers``."""

    def __init__(self) -> None:
        self.workers: list[WorkerInfo] = []

    def engines(self) -> dict[tuple[str, str], "_Engine"]:
        """Per (model name, engine): what its serving instances reported. Two versions of one model on one
        worker (mid-swap) share those labels, and a scrape must not repeat a series: their counters and
        histograms add up, the KV usage is the fuller one's, the cache config the first's."""
        out: dict[tuple[str, str], _Engine] = {}
        for worker in self.workers:
            for inst in worker.instances:
                if inst.engine is not None and inst.state in ("ready", "draining"):
                    out.setdefault((inst.name, worker.worker_id), _Engine(inst.engine)).add(inst.engine)
        return out

    def collect(self):
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage of each engine (1 = full)",
                                  labels=_LABELS)
        # vLLM V1 still serves the older name beside it, and its dashboard plots that one
        gpu_usage = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV-cache usage of each engine (1 = full); "
                                      "the older name of vllm:kv_cache_usage_perc", labels=_LABELS)
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked "
                                      "up", labels=_LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached",
                                   labels=_LABELS)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests preempted by each engine",
                                          labels=_LABELS)
        info = GaugeMetricFamily("vllm:cache_config_info", "Each engine's KV cache configuration (always 1)",
                                 labels=_CACHE_INFO)
        histograms = {name: HistogramMetricFamily(name, _DOCS[name], labels=_LABELS) for name in RELAYED_HISTOGRAMS}
        for (model, engine), e in sorted(self.engines().items()):
            labels = [model, engine]
            usage.add_metric(labels, e.kv_cache_usage)
            gpu_usage.add_metric(labels, e.kv_cache_usage)
            queries.add_metric(labels, e.prefix_cache_queries)
            hits.add_metric(labels, e.prefix_cache_hits)
            preemptions.add_metric(labels, e.preemptions)
            c = e.config
            info.add_metric([str(c.block_size), c.cache_dtype, str(c.enable_prefix_caching), engine, model,
                             str(c.num_gpu_blocks)], 1)
            for name, (counts, total) in e.histograms.items():
                bounds = (*RELAYED_HISTOGRAMS[name], math.inf)
                histograms[name].add_metric(labels, [(_bound(b), n) for b, n in zip(bounds, counts, strict=True)],
                                            total)
        yield from (usage, gpu_usage, queries, hits, preemptions, info, *histograms.values())


class _Engine:
    """One (model name, engine) series set, summed over the instances that share it."""

    def __init__(self, config: EngineStats):
        self.config = config  # block size, dtype, blocks, prefix caching: the first instance's
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = self.prefix_cache_hits = self.preemptions = 0
        self.histograms: dict[str, tuple[list[int], float]] = {}  # cumulative counts at vLLM's bounds, sum

    def add(self, stats: EngineStats) -> "_Engine":
        self.kv_cache_usage = max(self.kv_cache_usage, stats.kv_cache_usage)
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.preemptions += stats.preemptions
        for h in stats.histograms:
            bounds = RELAYED_HISTOGRAMS.get(h.name)
            if bounds is None:  # a newer worker's histogram this gateway does not know
                continue
            counts, total = self.histograms.get(h.name, ([0] * (len(bounds) + 1), 0.0))
            self.histograms[h.name] = ([a + b for a, b in zip(counts, h.counts_at(bounds), strict=True)],
                                       total + h.sum)
        return self
