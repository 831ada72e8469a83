"""Reading the gateway's TTFT stage split (gateway/ttft_stages.py) out of two /metrics scrapes: the
histograms diffed, each stage's p50 and p99 read from its buckets (linear within a bucket, as PromQL's
histogram_quantile), and for the slowest requests (the top TTFT classes holding at least TAIL of them) the
mean of each stage, which says where the tail's time went; and how many requests were not split (their workers
sent no stamps), whose TTFT the gateway's mean holds but the stages do not. `kvrelay bench serve --sweep` prints
it per trial (bench/ttft_stages.py)."""

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from kvrelay.gateway.ttft_stages import TTFT_CLASSES

STAGE_SECONDS = "kvrelay_ttft_stage_seconds"
BY_TTFT = "kvrelay_ttft_stage_by_ttft_seconds"
REQUESTS = "kvrelay_ttft_requests_by_ttft"
UNSPLIT = "kvrelay_ttft_unsplit"
TTFT = "vllm:time_to_first_token_seconds"  # the gateway's TTFT, which the stages tile
TAIL = 0.05
# series key: (sample name, sorted labels without model_name); a trial's requests all name one model
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Scrape:
    out: Scrape = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.name not in (STAGE_SECONDS, BY_TTFT, REQUESTS, UNSPLIT, TTFT):
            continue
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] += s.value
    return dict(out)


def diff(before: Scrape, after: Scrape) -> Scrape:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """``q`` of a histogram given as (upper bound, cumulative count) pairs, +Inf last; None when empty."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: its bound is all that is known
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return lower


def _le(value: str) -> float:
    return math.inf if value == "+Inf" else float(value)


def breakdown(delta: Scrape) -> dict:
    """Per stage p50 / p99 / mean in ms, and the slowest requests' mean per stage, from a diffed scrape."""
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    by_class: dict[float, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    requests: dict[float, float] = defaultdict(float)
    unsplit = 0.0
    ttft: dict[str, float] = defaultdict(float)
    for (name, labels), value in delta.items():
        lab = dict(labels)
        if name == f"{STAGE_SECONDS}_bucket":
            buckets[lab["stage"]].append((_le(lab["le"]), value))
        elif name == f"{STAGE_SECONDS}_sum":
            sums[lab["stage"]] += value
        elif name == f"{STAGE_SECONDS}_count":
            counts[lab["stage"]] += value
        elif name == f"{BY_TTFT}_total":
            by_class[_le(lab["ttft_le"])][lab["stage"]] += value
        elif name == f"{REQUESTS}_total":
            requests[_le(lab["ttft_le"])] += value
        elif name == f"{UNSPLIT}_total":
            unsplit += value
        elif name in (f"{TTFT}_sum", f"{TTFT}_count"):
            ttft[name.rsplit("_", 1)[1]] += value
    stages = {}
    for stage, b in buckets.items():
        p50, p99 = quantile(0.5, b), quantile(0.99, b)
        if p50 is None:
            continue
        if not sums[stage]:  # every one 0 (``requeue`` without requeues): not the midpoint of the first bucket
            p50 = p99 = 0.0
        stages[stage] = {"p50_ms": p50 * 1000, "p99_ms": p99 * 1000,
                         "mean_ms": sums[stage] / counts[stage] * 1000 if counts[stage] else 0.0}
    return {"requests": round(sum(requests.values())), "unsplit": round(unsplit), "stages": stages,
            "tail": _tail(by_class, requests),
            "ttft_mean_ms": ttft["sum"] / ttft["count"] * 1000 if ttft["count"] else None}


def _tail(by_class: dict[float, dict[str, float]], requests: dict[float, float]) -> dict | None:
    """The slowest TTFT classes that together hold at least TAIL of the requests: their count, the lowest
    TTFT they may hold (the bound below the lowest of them) and their mean per stage in ms."""
    total = sum(requests.values())
    if total <= 0:
        return None
    bounds = sorted((b for b, n in requests.items() if n > 0), reverse=True)
    taken, n = [], 0.0
    for bound in bounds:
        taken.append(bound)
        n += requests[bound]
        if n >= TAIL * total:
            break
    below = [b for b in TTFT_CLASSES if b < taken[-1]]
    stage_sums: dict[str, float] = defaultdict(float)
    for bound in taken:
        for stage, seconds in by_class[bound].items():
            stage_sums[stage] += seconds
    return {"requests": round(n), "ttft_above_ms": max(below) * 1000 if below else 0.0,
            "mean_ms": {stage: s / n * 1000 for stage, s in stage_sums.items()}}
