"""kvrelay serve clears a killed worker's registration itself (kvrelay/serve.py ``_unregister_worker``),
against a real Redis: the dead process's record goes at once, so gateways answer 503 for its models now
rather than once its heartbeat TTL lapses; a live worker's record, or one of another host with the same
pid, stays."""

import socket
import time

from kvrelay.serve import _unregister_worker
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client


def _register(r, worker_id: str, pid: int, host: str) -> None:
    now = time.time()
    info = WorkerInfo(worker_id=worker_id, role="decode", models=["m"], zmq_addr="tcp://127.0.0.1:1", free_blocks=1,
                      total_blocks=1, running=0, waiting=0, pid=pid, host=host, started=now, heartbeat=now)
    r.set(keys.worker_key(worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
    r.sadd(keys.WORKERS_INDEX, worker_id)


def test_the_dead_workers_registration_goes_and_no_other(redis_url):
    r = sync_client(redis_url)
    r.flushall()
    here = socket.gethostname()
    _register(r, "dead", 4242, here)
    _register(r, "alive", 4243, here)
    _register(r, "elsewhere", 4242, "another-host")
    _unregister_worker(redis_url, 4242)
    assert not r.exists(keys.worker_key("dead")) and not r.sismember(keys.WORKERS_INDEX, "dead")
    assert r.exists(keys.worker_key("alive")) and r.exists(keys.worker_key("elsewhere"))
    assert {m.decode() for m in r.smembers(keys.WORKERS_INDEX)} == {"alive", "elsewhere"}
