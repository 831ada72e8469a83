"""Where a request's time to first token goes, stage by stage, as ``kvrelay_ttft_stage_seconds{stage}``.

The stages tile the gateway's TTFT (arrival here to the first token here) without gap or overlap:

- ``gateway``: arrival to its jobs sent to Redis (limits, routing)
- ``redis``: sent to a worker reading the job from its stream (the XADD, the stream, the worker's read)
- ``prefill_wait``: read to the start of the engine step that sampled its first token: waiting for a step
  slot, and the steps that computed its earlier prompt chunks
- ``prefill_step``: that step, to its first token sampled
- ``return``: sampled to the token here (the rest of the worker's loop, ZMQ, the gateway's loop)

Worker stamps arrive on the first TokenEvent (``first_token_times``). Across processes the clocks are wall
clocks (time.time()): exact on one host, off by the clock skew between hosts otherwise; a negative stage
(skew) is observed as 0. Beside each stage's histogram, ``kvrelay_ttft_stage_by_ttft_seconds`` sums each
stage per TTFT class, with ``kvrelay_ttft_requests_by_ttft`` counting the requests of each class, so a
reader can say what the slowest requests spent their time on (bench/ttft_stages.py).
"""

from prometheus_client import CollectorRegistry, Counter, Histogram

STAGES = ("gateway", "redis", "prefill_wait", "prefill_step", "return")
# fine enough (about 12% apart from 1 ms to 10 s) that a p99 read from the buckets lands within a bucket's width
STAGE_BUCKETS = tuple(round(0.001 * 1.12 ** i, 5) for i in range(82))
# TTFT classes for the per-class sums: the tail of a sweep's trial lies between tens of ms and a few seconds
TTFT_CLASSES = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


def split(arrival: float, queued: float, times: dict[str, float], first_token: float) -> dict[str, float]:
    """Each stage's seconds for one request (unix times; the worker's from ``first_token_times``)."""
    marks = (arrival, queued, times["fetched"], times["step_started"], times["sampled"], first_token)
    return {stage: marks[i + 1] - marks[i] for i, stage in enumerate(STAGES)}


def ttft_class(ttft: float) -> str:
    """The upper bound of the TTFT class ``ttft`` falls in, as Prometheus writes a bucket's ``le``."""
    return next((f"{bound:g}" for bound in TTFT_CLASSES if ttft <= bound), "+Inf")


class TtftStages:
    def __init__(self, registry: CollectorRegistry):
        m = ["model_name"]
        self.seconds = Histogram("kvrelay_ttft_stage_seconds", "The gateway's time to first token split into "
                                 "stages: gateway, redis, prefill_wait, prefill_step, return (README)",
                                 m + ["stage"], buckets=STAGE_BUCKETS, registry=registry)
        self.by_ttft = Counter("kvrelay_ttft_stage_by_ttft_seconds", "Seconds spent in each TTFT stage, summed per "
                               "class of the request's TTFT (ttft_le: the class's upper bound)",
                               m + ["stage", "ttft_le"], registry=registry)
        self.requests = Counter("kvrelay_ttft_requests_by_ttft", "Requests with a TTFT stage split, per TTFT class",
                                m + ["ttft_le"], registry=registry)

    def observe(self, model: str, arrival: float, queued: float, times: dict[str, float], first_token: float) -> None:
        if not queued or any(name not in times for name in ("fetched", "step_started", "sampled")):
            return  # a worker that stamps nothing (an older one), or a job queued again: no split
        le = ttft_class(first_token - arrival)
        self.requests.labels(model, le).inc()
        for stage, seconds in split(arrival, queued, times, first_token).items():
            seconds = max(0.0, seconds)
            self.seconds.labels(model, stage).observe(seconds)
            self.by_ttft.labels(model, stage, le).inc(seconds)
