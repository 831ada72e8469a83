"""The TTFT stage split: the gateway's series (gateway/ttft_stages.py) written into a real registry and
read back by the sweep's scrape-and-diff (kvrelay/ttft_readout.py): quantiles from buckets, the slowest
requests' mean per stage from the per-TTFT-class sums, a requeued request's time before its last run in
``requeue``, and the requests without worker stamps counted unsplit."""

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvrelay.gateway.ttft_stages import STAGE_BUCKETS, STAGES, TtftStages, split, ttft_class
from kvrelay.shared.wire.protocol import FIRST_TOKEN_STAMPS
from kvrelay.ttft_readout import breakdown, diff, parse, quantile


def _observe(stages: TtftStages, arrival: float, ms: tuple[float, ...], model: str = "m") -> None:
    """One request whose stages took ``ms`` (in STAGES order), from ``arrival``."""
    marks = [arrival]
    for m in ms:
        marks.append(marks[-1] + m / 1000)
    times = dict(zip(FIRST_TOKEN_STAMPS, marks[4:8], strict=True))
    stages.observe(model, arrival, sorted({marks[1], marks[2]}), times, marks[8], asked=marks[3])


def test_split_tiles_the_ttft():
    times = {"fetched": 10.3, "step_started": 10.5, "sampled": 10.9, "flushed": 10.95}
    parts = split(10.0, [10.1], times, 11.0)
    assert list(parts) == list(STAGES)
    assert parts == pytest.approx({"gateway": 0.1, "requeue": 0.0, "stream_wait": 0.0, "redis": 0.2,
                                   "prefill_wait": 0.2, "prefill_step": 0.4, "worker_send": 0.05, "return": 0.05})
    assert sum(parts.values()) == pytest.approx(1.0)


def test_the_wait_for_a_busy_worker_is_told_from_the_read():
    """Queued at 10.1; the worker, in a step, issues its next read at 10.25, which returns at 10.3: 0.15 s in
    ``stream_wait``, 0.05 in ``redis``. A read issued before the enqueue (the worker was blocked waiting for a
    job) leaves ``stream_wait`` 0 and the whole wait in ``redis``."""
    times = {"fetched": 10.3, "step_started": 10.5, "sampled": 10.9, "flushed": 10.95}
    busy = split(10.0, [10.1], times, 11.0, asked=10.25)
    assert (busy["stream_wait"], busy["redis"]) == pytest.approx((0.15, 0.05))
    idle = split(10.0, [10.1], times, 11.0, asked=10.05)
    assert (idle["stream_wait"], idle["redis"]) == pytest.approx((0.0, 0.2))
    assert sum(busy.values()) == sum(idle.values()) == pytest.approx(1.0)


def test_a_requeued_requests_redis_stage_runs_from_the_enqueue_its_first_token_came_from():
    """Queued at 10.1 and again at 12.0: a first token of the re-run spent 10.1 to 12.0 in ``requeue``; one of
    the first run that arrives late (read before the requeue) has none there, as if never queued again."""
    rerun = split(10.0, [10.1, 12.0], {"fetched": 12.3, "step_started": 12.5, "sampled": 12.9, "flushed": 12.95}, 13.0)
    assert rerun == pytest.approx({"gateway": 0.1, "requeue": 1.9, "stream_wait": 0.0, "redis": 0.3, "prefill_wait": 0.2,
                                   "prefill_step": 0.4, "worker_send": 0.05, "return": 0.05})
    first_run = split(10.0, [10.1, 12.0], {"fetched": 10.3, "step_started": 10.5, "sampled": 12.1, "flushed": 12.2},
                      12.4)
    assert first_run == pytest.approx({"gateway": 0.1, "requeue": 0.0, "stream_wait": 0.0, "redis": 0.2, "prefill_wait": 0.2,
                                       "prefill_step": 1.6, "worker_send": 0.1, "return": 0.2})
    assert sum(rerun.values()) == pytest.approx(3.0) and sum(first_run.values()) == pytest.approx(2.4)


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
    _observe(stages, 0.0, (900,) * 8)  # before the trial: must not count
    before = parse(generate_latest(registry).decode())
    # TTFTs 60 and 600 ms: the tail waited for a step and for its re-run
    fast, slow = (2, 0, 3, 2, 10, 40, 1, 2), (2, 300, 55, 5, 195, 40, 1, 2)
    for i in range(95):
        _observe(stages, float(i), fast)
    for i in range(5):
        _observe(stages, 100.0 + i, slow)
    b = breakdown(diff(before, parse(generate_latest(registry).decode())))
    assert b["requests"] == 100
    width = STAGE_BUCKETS[1] / STAGE_BUCKETS[0]  # a bucket's upper bound over its lower one
    for i, stage in enumerate(STAGES):
        s = b["stages"][stage]
        if fast[i]:
            assert fast[i] / width <= s["p50_ms"] <= fast[i] * width
        else:  # every fast request's in the first bucket, from 0
            assert s["p50_ms"] <= STAGE_BUCKETS[0] * 1000
        assert s["mean_ms"] == pytest.approx((95 * fast[i] + 5 * slow[i]) / 100)
    assert b["stages"]["prefill_wait"]["p99_ms"] >= 195 / width
    tail = b["tail"]
    assert tail["requests"] == 5 and 600 / 1.2 <= tail["ttft_above_ms"] < 600  # the class bound below 600 ms
    assert tail["mean_ms"] == pytest.approx(dict(zip(STAGES, slow, strict=True)))


def test_a_stage_that_took_no_time_in_any_request_reads_0_not_its_first_buckets_midpoint():
    registry = CollectorRegistry()
    stages = TtftStages(registry)
    for i in range(3):
        _observe(stages, float(i), (2, 0, 0, 5, 10, 40, 1, 2))
    b = breakdown(parse(generate_latest(registry).decode()))
    assert b["stages"]["requeue"] == {"p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0}
    assert b["stages"]["gateway"]["p50_ms"] > 0


def test_a_request_without_every_worker_stamp_is_counted_unsplit():
    registry = CollectorRegistry()
    stages = TtftStages(registry)
    stages.observe("m", 0.0, [0.1], None, 1.0)  # a worker older than the stamps
    stages.observe("m", 0.0, [0.1], {"fetched": 0.2, "step_started": 0.3, "sampled": 0.4}, 1.0)  # a stamp short
    b = breakdown(parse(generate_latest(registry).decode()))
    assert (b["requests"], b["unsplit"], b["stages"], b["tail"]) == (0, 2, {}, None)
    _observe(stages, 2.0, (1,) * 8)
    b = breakdown(parse(generate_latest(registry).decode()))
    assert (b["requests"], b["unsplit"]) == (1, 2)
