"""Every Redis key, stream, group and channel name kvrelay uses, and the timing constants that go
with them. Values stored under these keys are ``shared.protocol`` messages (msgpack bytes).

    prefill_stream(model)     stream; gateway XADDs {JOB_FIELD: encode(Job)}; prefill workers read it
                              through consumer group PREFILL_GROUP (create it with id "0" + MKSTREAM so
                              jobs queued before the first worker are not skipped)
    dead_letter_stream(model) stream; jobs delivered more than MAX_DELIVERIES times, same field
    worker_key(worker_id)     string, encode(WorkerInfo), SET with EX=HEARTBEAT_TTL_S every
                              HEARTBEAT_INTERVAL_S; the id is also SADDed to WORKERS_INDEX
    model_key(name)           string, encode(ModelInfo), no TTL; the name is SADDed to MODELS_INDEX
    ABORT_CHANNEL             pub/sub; gateway PUBLISHes encode(Abort); every worker subscribes
"""

PREFIX = "kvrelay"

PREFILL_GROUP = f"{PREFIX}-prefill"
JOB_FIELD = "data"
WORKERS_INDEX = f"{PREFIX}:workers"
MODELS_INDEX = f"{PREFIX}:models"
ABORT_CHANNEL = f"{PREFIX}:abort"

HEARTBEAT_INTERVAL_S = 2.0
# Several missed heartbeats before a worker counts as dead: a GC pause or a long prefill step must not
# make the gateway answer 503.
HEARTBEAT_TTL_S = 10
# A job that made this many workers fail is poison; it goes to the dead-letter stream, not round again.
MAX_DELIVERIES = 3
# Approximate cap (XADD MAXLEN ~) so an idle model's stream cannot grow without bound.
STREAM_MAXLEN = 100_000


def prefill_stream(model: str) -> str:
    return f"{PREFIX}:prefill:{model}"


def dead_letter_stream(model: str) -> str:
    return f"{PREFIX}:deadletter:{model}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def model_key(name: str) -> str:
    return f"{PREFIX}:model:{name}"
