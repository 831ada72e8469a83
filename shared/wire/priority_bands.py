"""Priority bands: how the backlog of a model served under ``--scheduling-policy priority`` waits in Redis.

A worker's engine orders only the jobs it has taken; a backlog waits in Redis, so the order in which jobs
leave Redis is what decides who waits there. A priority model's jobs go to one stream per band, and workers
take from the best non-empty band first, so a job of a better band waiting in Redis is taken before every
job of a worse one, whenever each arrived. Within a band a stream keeps arrival order (FIFO); the worker's
engine then orders what it took by (priority, arrival) as vLLM's priority policy does.

Bands follow vLLM's meaning of ``priority``: a LOWER value is served first, 0 is the default. The value is
clamped to ``-BAND_LIMIT..BAND_LIMIT``, one band each: priorities beyond the limit share the edge band, in
arrival order among themselves. A fixed, small number of streams keeps a worker's read one script over a
handful of keys, and the gateway's depth and the gauges a few XLENs, whatever priorities clients send.

Band 0 is the model's shared stream itself (``prefill_stream``): the only stream of a model served first
come, first served, whose path stays exactly as it was, and the only band the gateway routes to a worker's
private stream (prefix affinity): a job of another band goes to its band's stream, since a private stream is
read ahead of band 0 but must not be read ahead of a better band.

A model swapped from priority to first come, first served leaves its band backlog where it was: its workers
find it by an XLEN per band once a second (job_queue.py) and take it, in arrival order within each band.

Starvation: strict, as vLLM's own priority policy is. A worse band is read only while every better band is
empty, so under a sustained overload of better jobs a worse job may wait until its deadline: its client
then gets the gateway's timeout, and a worker that takes the job later drops it unrun (its deadline has
passed). No aging: a job taken early from Redis would only wait again in the engine, whose priority
order puts it behind the same better jobs.
"""

from kvrelay.shared.wire import redis_keys as keys

BAND_LIMIT = 2
BANDS = tuple(range(-BAND_LIMIT, BAND_LIMIT + 1))  # best first: the order a worker reads them in


def band_of(priority: int) -> int:
    return max(-BAND_LIMIT, min(BAND_LIMIT, priority))


def band_stream(model: str, band: int) -> str:
    return keys.prefill_stream(model) if band == 0 else keys.prefill_band_stream(model, band)


def job_stream(model: str, priority: int, scheduling_policy: str) -> str:
    """Where the gateway queues a job of ``priority`` for ``model``, served under ``scheduling_policy``."""
    if scheduling_policy != "priority":
        return keys.prefill_stream(model)
    return band_stream(model, band_of(priority))


def band_streams(model: str) -> list[str]:
    """Every band's stream of ``model``, best band first."""
    return [band_stream(model, band) for band in BANDS]


def shared_streams(model: str) -> list[str]:
    """The streams any worker of ``model`` takes from, band 0 (the shared stream, a first come, first served
    model's only one) first: what a backlog counts over, whatever the model's policy was when it queued."""
    return [keys.prefill_stream(model), *(keys.prefill_band_stream(model, b) for b in BANDS if b)]
