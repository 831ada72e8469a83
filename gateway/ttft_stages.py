"""Where a request's time to first token goes, stage by stage, as ``kvrelay_ttft_stage_seconds{stage}``.

A request is one job, as in the gateway's TTFT histograms: each choice of ``n`` has its own first token. The
stages tile the gateway's TTFT (arrival here to the first token here) without gap or overlap:

- ``gateway``: arrival (the request reaching the gateway's handlers, errors.ARRIVAL) to its job first sent to
  Redis: reading its body, checking its key, preparing its prompt, limits, routing
- ``requeue``: that to the enqueue the first token came from: 0 unless the gateway queued the job again
  (its decode worker died holding it, generation.py), when it is the first run's time in Redis, on its
  workers and until the holder was seen dead
- ``stream_wait``: that enqueue to the worker issuing the read that returned the job: the job waiting in its
  stream for a worker free to read it (the step it was running), or a dead worker's job until a peer reclaimed it
- ``redis``: the later of that enqueue and that read's issue, to the read's return (the XADD, a read blocked
  waiting for a job, the round trip); all of the enqueue to the read for a worker that sends no ``fetch_asked``
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
(skew) is observed as 0. The enqueue a first token came from is the last one before the worker's read of the
job (an earlier run's token may still arrive after a requeue). Jobs redelivered without the gateway (a peer
reclaiming a dead or stalled worker's job, a draining worker handing its jobs back) are one enqueue to the
gateway: the time before the last worker's read is in ``stream_wait``, where the job sat pending until taken
over.

A first token without every stamp (a worker older than the stamps, or one that sent some only) is not split
but counted in ``kvrelay_ttft_unsplit_total``, so split plus unsplit is every first token. Beside each stage's
histogram, ``kvrelay_ttft_stage_by_ttft_seconds`` sums each stage per TTFT class, with
``kvrelay_ttft_requests_by_ttft`` counting the requests of each class, so a reader can say what the slowest
requests spent their time on (kvrelay/ttft_readout.py).
"""

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvrelay.shared.wire.protocol import FIRST_TOKEN_STAMPS

STAGES = ("gateway", "requeue", "stream_wait", "redis", "prefill_wait", "prefill_step", "worker_send", "return")
# fine enough (about 12% apart from 1 ms to 10 s) that a p99 read from the buckets lands within a bucket's width
STAGE_BUCKETS = tuple(round(0.001 * 1.12 ** i, 5) for i in range(82))
# TTFT classes for the per-class sums, 20% apart from 5 ms to 18 s: fine enough that the slowest classes
# holding 5% of a trial's requests hold not many more
TTFT_CLASSES = tuple(round(0.005 * 1.2 ** i, 5) for i in range(46))


def split(arrival: float, enqueued: Sequence[float], times: dict[str, float], first_token: float,
          asked: float | None = None) -> dict[str, float]:
    """Each stage's seconds for one request (unix times: ``enqueued``, when its job went to Redis, first to
    last; the worker's from ``first_token_times``, and ``asked``, its ``fetch_asked``)."""
    run_from = max((t for t in enqueued if t <= times["fetched"]), default=enqueued[0])
    read_from = run_from if asked is None else min(max(run_from, asked), times["fetched"])
    marks = (arrival, enqueued[0], run_from, read_from, *(times[name] for name in FIRST_TOKEN_STAMPS), first_token)
    return {stage: marks[i + 1] - marks[i] for i, stage in enumerate(STAGES)}


def ttft_class(ttft: float) -> str:
    """The upper bound of the TTFT class ``ttft`` falls in, as Prometheus writes a bucket's ``le``."""
    return next((f"{bound:g}" for bound in TTFT_CLASSES if ttft <= bound), "+Inf")


class TtftStages:
    def __init__(self, registry: CollectorRegistry):
        m = ["model_name"]
        self.seconds = Histogram("kvrelay_ttft_stage_seconds", "The gateway's time to first token split into "
                                 f"stages: {', '.join(STAGES)} (README)",
                                 m + ["stage"], buckets=STAGE_BUCKETS, registry=registry)
        self.by_ttft = Counter("kvrelay_ttft_stage_by_ttft_seconds", "Seconds spent in each TTFT stage, summed per "
                               "class of the request's TTFT (ttft_le: the class's upper bound)",
                               m + ["stage", "ttft_le"], registry=registry)
        self.requests = Counter("kvrelay_ttft_requests_by_ttft", "Requests with a TTFT stage split, per TTFT class",
                                m + ["ttft_le"], registry=registry)
        self.unsplit = Counter("kvrelay_ttft_unsplit", "Requests whose first token came without every worker "
                               "stamp (a worker older than them), so with no TTFT stage split", m, registry=registry)

    def observe(self, model: str, arrival: float, enqueued: Sequence[float], times: dict[str, float] | None,
                first_token: float, asked: float | None = None) -> None:
        """A request's first token, at ``first_token``; ``times``: its event's stamps (None: it had none), and
        ``asked`` its ``fetch_asked``."""
        if times is None or any(name not in times for name in FIRST_TOKEN_STAMPS):
            self.unsplit.labels(model).inc()
            return
        le = ttft_class(first_token - arrival)
        self.requests.labels(model, le).inc()
        for stage, seconds in split(arrival, enqueued, times, first_token, asked).items():
            seconds = max(0.0, seconds)
            self.seconds.labels(model, stage).observe(seconds)
            self.by_ttft.labels(model, stage, le).inc(seconds)
