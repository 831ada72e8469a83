"""The live workers as their heartbeats describe them, read synchronously (workers, the launcher); the
gateway's cached, asynchronous view is gateway/control/worker_registry.py."""

import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import WorkerInfo


def live_workers(r: redis.Redis) -> list[WorkerInfo]:
    """Workers whose heartbeat record has not expired (a malformed record counts as no worker)."""
    ids = r.smembers(keys.WORKERS_INDEX)
    raws = r.mget([keys.worker_key(i.decode()) for i in ids]) if ids else []
    workers = []
    for raw in raws:
        if raw is None:
            continue
        try:
            workers.append(decode(raw, WorkerInfo))
        except ValueError:
            continue
    return workers
