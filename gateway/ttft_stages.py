"""Where a request's time to first token goes, stage by stage, as ``kvrelay_ttft_stage_seconds{stage}``.

The stages tile the gateway's TTFT (arrival here to the first token here) without gap or overlap:

- ``gateway``: arrival to its jobs sent to Redis (limits, routing)
- ``redis``: sent to a worker reading the job from its stream (the XADD, the stream, the worker's read)
- ``prefill_wait``: read to the start of the engine step that sampled its first token: waiting for a step
  slot, and the steps that computed its earlier prompt chunks
- ``prefill_step``: that step, to its first token sampled (a unified worker with --async-scheduling gets
  a step's tokens from the step after it, so there this is that later step and the sampling step is in
  ``prefill_wait``)
- ``worker_send``: sampled to its event sent, at the end of the worker's loop (a prefill worker starts the
  KV handoff and polls its transfers in between)
- ``return``: sent to the token here (ZMQ, the gateway's loop)

Worker stamps arrive on the first TokenEvent (``first_token_times``). Across processes the clocks are wall
clocks (time.time()): exact on one host, off by the clock skew between hosts otherwise; a negative stage
(skew) is observed as 0. Beside each stage's histogram, ``kvrelay_ttft_stage_by_ttft_seconds`` sums each
stage per TTFT class, with ``kvrelay_ttft_requests_by_ttft`` counting the requests of each class, so a
reader can say what the slowest requests spent their time on (bench/ttft_stages.py).
"""

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvrelay.shared.wire.protocol import FIRST_TOKEN_STAMPS

STAGES = ("gateway", "redis", "prefill_wait", "prefill_step", "worker_send", "return")
# fine enough (about 12% apart from 1 ms to 10 s) that a p99 read from the buckets lands within a bucket's width
STAGE_BUCKETS = tuple(round(0.001 * 1.12 ** i, 5) for i in range(82))
# TTFT classes for the per-class sums, 20% apart from 5 ms to 18 s: fine enough that the slowest classes
# holding 5% of a trial's requests hold not many more
TTFT_CLASSES = tuple(round(0.005 * 1.2 ** i, 5) for i in range(46))


def split(arrival: float, queued: float, times: dict[str, float], first_token: float) -> dict[str, float]:
    """Each stage's seconds for one request (unix times; the worker's from ``first_token_times``)."""
    marks = (arrival, queued, *(times[name] for name in FIRST_TOKEN_STAMPS), first_token)
    return {stage: marks[i + 1] - marks[i] for i, stage in enumerate(STAGES)}


def ttft_class(ttft: float) -> str:
    """The upper bound of the TTFT class ``ttft`` falls in, as Prometheus writes a bucket's ``le``."""
    return next((f"{bound:g}" for bound in TTFT_CLASSES if ttft <= bound), "+Inf")


class TtftStages:
    def __init__(self, registry: CollectorRegistry):
        m = ["model_name"]
        self.seconds = Histogram("kvrelay_ttft_stage_seconds", "The gateway's time to first token split into "
                                 "stages: gateway, redis, prefill_wait, prefill_step, worker_send, return (README)",
                                 m + ["stage"], buckets=STAGE_BUCKETS, registry=registry)
        self.by_ttft = Counter("kvrelay_ttft_stage_by_ttft_seconds", "Seconds spent in each TTFT stage, summed per "
                               "class of the request's TTFT (ttft_le: the class's upper bound)",
                               m + ["stage", "ttft_le"], registry=registry)
        self.requests = Counter("kvrelay_ttft_requests_by_ttft", "Requests with a TTFT stage split, per TTFT class",
                                m + ["ttft_le"], registry=registry)

    def observe(self, model: str, arrival: float, queued: float, times: dict[str, float], first_token: float) -> None:
        if not queued or any(name not in times for name in FIRST_TOKEN_STAMPS):
            return  # a worker that stamps nothing (an older one), or a job queued again: no split
        le = ttft_class(first_token - arrival)
        self.requests.labels(model, le).inc()
        for stage, seconds in split(arrival, queued, times, first_token).items():
            seconds = max(0.0, seconds)
            self.seconds.labels(model, stage).observe(seconds)
            self.by_ttft.labels(model, stage, le).inc(seconds)
