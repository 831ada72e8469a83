"""``LocalCluster.wait_ready`` returns only once each gateway's /ready counts the models its workers publish: a
gateway started without models says 200 from a reading taken before any worker registered (its registry
cache), and a benchmark that then lists /v1/models finds nothing. Real Redis; the gateway is a small HTTP
server answering as such a gateway does, a stale 200 first."""

import threading

import pytest

from kvrelay.local_cluster import LocalCluster
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from tests.scripted_http import ScriptedJSON

STALE_ANSWERS = 3


def record(worker_id: str, models: list[str]) -> bytes:
    return encode(WorkerInfo(worker_id=worker_id, role="prefill", models=models, zmq_addr="tcp://127.0.0.1:1",
                             free_blocks=1, total_blocks=1, running=0, waiting=0, pid=1, host="h", started=0.0,
                             heartbeat=0.0))


@pytest.fixture
def gateway():
    stale = [{"status": "ready", "models": {}}] * STALE_ANSWERS
    server = ScriptedJSON([*stale, {"status": "ready", "models": {"tiny": {"prefill_workers": 1, "decode_workers": 1}}}])
    yield server
    server.close()


def test_wait_ready_waits_past_a_200_that_counts_no_model(redis_url, tmp_path, gateway, monkeypatch):
    monkeypatch.setenv("KVRELAY_SHARE_WEIGHTS_DIR", str(tmp_path))  # no weight-sharing folder of its own
    cluster = LocalCluster(redis_url, tmp_path)
    cluster.workers.append("p1")
    cluster.gateway_ports["gateway"] = gateway.port
    redis = sync_client(redis_url)
    try:
        redis.set(keys.worker_key("p1"), record("p1", []))  # registered, still loading
        loaded = threading.Timer(0.5, lambda: redis.set(keys.worker_key("p1"), record("p1", ["tiny"])))
        loaded.start()
        cluster.wait_ready(timeout=30)
        loaded.join()
        assert gateway.polls == STALE_ANSWERS + 1  # asked only after its model loaded, until /ready counted it
    finally:
        redis.delete(keys.worker_key("p1"))
        redis.close()
