"""The TTFT stage split: the gateway's series (gateway/ttft_stages.py) written into a real registry and
read back by the sweep's scrape-and-diff (kvrelay/ttft_readout.py): quantiles from buckets, and the
slowest requests' mean per stage from the per-TTFT-class sums."""

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvrelay.gateway.ttft_stages import STAGE_BUCKETS, STAGES, TtftStages, split, ttft_class
from kvrelay.ttft_readout import breakdown, diff, parse, quantile


def _observe(stages: TtftStages, arrival: float, ms: tuple[float, ...], model: str = "m") -> None:
    """One request whose stages took ``ms`` (in STAGES order), from ``arrival``."""
    marks = [arrival]
    for m in ms:
        marks.append(marks[-1] + m / 1000)
    times = {"fetched": marks[2], "step_started": marks[3], "sampled": marks[4], "flushed": marks[5]}
    stages.observe(model, arrival, marks[1], times, marks[6])


def test_split_tiles_the_ttft():
    times = {"fetched": 10.3, "step_started": 10.5, "sampled": 10.9, "flushed": 10.95}
    parts = split(10.0, 10.1, times, 11.0)
    assert list(parts) == list(STAGES)
    assert parts == pytest.approx({"gateway": 0.1, "redis": 0.2, "prefill_wait": 0.2, "prefill_step": 0.4,
                                   "worker_send": 0.05, "return": 0.05})
    assert sum(parts.values()) == pytest.approx(1.0)


def test_ttft_class_is_the_first_bound_at_or_above():
    assert (ttft_class(0.001), ttft_class(0.006), ttft_class(0.0072), ttft_class(60.0)) == ("0.005", "0.006", "0.0072",
                                                                                          "+Inf")


def test_quantile_interpolates_within_a_bucket_as_histogram_quantile():
    buckets = [(0.1, 0.0), (0.2, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.15)
    assert quantile(0.99, buckets) == pytest.approx(0.199)
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1  # beyond the last bound: that bound


def test_a_trial_diff_gives_each_stage_and_the_tail_its_time():
    registry = CollectorRegistry()
    stages = TtftStages(registry)
    _observe(stages, 0.0, (900,) * 6)  # before the trial: must not count
    before = parse(generate_latest(registry).decode())
    fast, slow = (2, 5, 10, 40, 1, 2), (2, 5, 250, 40, 1, 2)  # TTFTs 60 and 300 ms: the tail waited for a step
    for i in range(95):
        _observe(stages, float(i), fast)
    for i in range(5):
        _observe(stages, 100.0 + i, slow)
    b = breakdown(diff(before, parse(generate_latest(registry).decode())))
    assert b["requests"] == 100
    width = STAGE_BUCKETS[1] / STAGE_BUCKETS[0]  # a bucket's upper bound over its lower one
    for i, stage in enumerate(STAGES):
        s = b["stages"][stage]
        assert fast[i] / width <= s["p50_ms"] <= fast[i] * width
        assert s["mean_ms"] == pytest.approx((95 * fast[i] + 5 * slow[i]) / 100)
    assert b["stages"]["prefill_wait"]["p99_ms"] >= 250 / width
    tail = b["tail"]
    assert tail["requests"] == 5 and 300 / 1.2 <= tail["ttft_above_ms"] < 300  # the class bound below 300 ms
    assert tail["mean_ms"] == pytest.approx(dict(zip(STAGES, slow, strict=True)))


def test_a_request_without_worker_stamps_is_not_split():
    registry = CollectorRegistry()
    stages = TtftStages(registry)
    stages.observe("m", 0.0, 0.1, {}, 1.0)
    stages.observe("m", 0.0, 0.1, {"fetched": 0.2, "step_started": 0.3, "sampled": 0.4}, 1.0)  # a stamp short
    stages.observe("m", 0.0, 0.0, dict.fromkeys(("fetched", "step_started", "sampled", "flushed"), 0.5), 1.0)
    b = breakdown(parse(generate_latest(registry).decode()))
    assert (b["requests"], b["stages"], b["tail"]) == (0, {}, None)
