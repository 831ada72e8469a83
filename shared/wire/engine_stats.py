"""An engine's vLLM-named statistics as its worker's heartbeat carries them (``InstanceStatus.engine``),
so the gateway can serve them on the API port beside its request-level series: vLLM serves engine and
request metrics on one port, and a dashboard built for it reads both from there.

Workers keep the live series in their own registry (shared/worker/metrics.py, ``--monitoring-port``); a
heartbeat (every ``HEARTBEAT_INTERVAL_S``) snapshots them here: lifetime counters, the KV usage of the
moment, and each histogram as cumulative counts per upper bound. The bucket bounds below are vLLM V1's
(vllm/v1/metrics/loggers.py); a worker's own histogram may be finer, as long as every vLLM bound is one
of its bounds, so the gateway reads vLLM's buckets off it exactly (``counts_at``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from kvrelay.shared.wire.codec import register

# vLLM V1's buckets for tokens per engine step
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM V1's buckets for every per-request span (e2e, queue, inference, prefill, decode), in seconds
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# the relayed histograms, by vLLM's name, with vLLM's bounds
RELAYED_HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
}


@dataclass
class HistogramCounts:
    """One histogram: ``counts[i]`` observations at or below ``bounds[i]`` (cumulative, as Prometheus'
    ``le``); the last bound is +Inf, so the last count is the total."""

    TAG: ClassVar[str] = "histogram_counts"
    name: str
    bounds: list[float]
    counts: list[int]
    sum: float = 0.0

    def check(self) -> None:
        if len(self.bounds) != len(self.counts) or not self.bounds or self.bounds[-1] != math.inf:
            raise ValueError(f"histogram {self.name!r}: bounds and counts differ in length or lack +Inf")

    def counts_at(self, bounds: tuple[float, ...]) -> list[int]:
        """Cumulative counts at ``bounds`` and +Inf. A bound this histogram lacks reads the count at its
        nearest lower bound (never more than the truth)."""
        out = []
        for bound in (*bounds, math.inf):
            below = [c for b, c in zip(self.bounds, self.counts, strict=True) if b <= bound]
            out.append(below[-1] if below else 0)
        return out


@dataclass
class EngineStats:
    """One model instance's engine, as of the heartbeat that carries it."""

    TAG: ClassVar[str] = "engine_stats"
    kv_cache_usage: float = 0.0  # fraction of its KV blocks in use
    prefix_cache_queries: int = 0  # lifetime prompt tokens looked up
    prefix_cache_hits: int = 0  # and found
    preemptions: int = 0  # lifetime
    # what vLLM's ``vllm:cache_config_info`` shows of its cache config
    block_size: int = 0
    num_gpu_blocks: int = 0
    cache_dtype: str = ""
    enable_prefix_caching: bool = False
    histograms: list[HistogramCounts] = field(default_factory=list)


register(HistogramCounts, EngineStats)
