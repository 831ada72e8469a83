"""A model record an older kvrelay wrote without a TTL, in a Redis that outlived it, expires like any other
once no live worker holds it: the gateway's reconciler gives it ``MODEL_TTL_S``. A record a live worker
holds, and one that has its TTL, are left as they are. The real gateway app as the gateway's own ACL user
of a real redis-server (the embedded Redis), the records written as its admin."""

import asyncio
import time
from collections.abc import Iterator

import pytest

from kvrelay.gateway.control.reconciler import RECONCILER
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ModelInfo, WorkerInfo
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client
from tests.integration.gateway_harness import GatewayServer, gateway_config

pytestmark = pytest.mark.timeout(120)

LEFT_TTL_S = 100  # what the record with a TTL has left: the pass must not reset it


@pytest.fixture(scope="module")
def embedded() -> Iterator[EmbeddedRedis]:
    redis = EmbeddedRedis()
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()


def _publish(r, name: str, ex: int | None = None) -> None:
    info = ModelInfo(name=name, path="/nonexistent", max_model_len=64, vocab_size=100, eos_token_ids=[0],
                     block_size=16, dtype="float32")
    r.set(keys.model_key(name), encode(info), ex=ex)
    r.sadd(keys.MODELS_INDEX, name)


def _live_worker(r, worker_id: str, models: list[str]) -> None:
    now = time.time()
    worker = WorkerInfo(worker_id=worker_id, role="unified", models=models, zmq_addr="tcp://127.0.0.1:1",
                        free_blocks=1, total_blocks=1, running=0, waiting=0, pid=1, host="h", started=now,
                        heartbeat=now)
    r.set(keys.worker_key(worker_id), encode(worker), ex=keys.HEARTBEAT_TTL_S)
    r.sadd(keys.WORKERS_INDEX, worker_id)


def test_a_record_without_ttl_that_no_live_worker_holds_gets_the_model_ttl(embedded):
    admin = sync_client(embedded.url)
    admin.flushall()
    _publish(admin, "legacy")  # direct, its workers gone: would answer 503 for good
    _publish(admin, "legacy@2")  # a registered instance's record, as lasting
    _publish(admin, "held")  # no TTL either, but a live (older) worker holds it
    _live_worker(admin, "w1", ["held"])
    _publish(admin, "lapsing", ex=LEFT_TTL_S)
    # no reconciler task: only the pass this test runs touches the records
    server = GatewayServer(gateway_config(embedded.role_url("gateway"), reconcile_interval_s=0.0)).start()
    try:
        assert asyncio.run_coroutine_threadsafe(server.app[RECONCILER].run_once(), server.loop).result(60)
    finally:
        server.stop()
    for name in ("legacy", "legacy@2"):
        assert 0 < admin.ttl(keys.model_key(name)) <= keys.MODEL_TTL_S, name
    assert admin.ttl(keys.model_key("held")) == -1
    assert 0 < admin.ttl(keys.model_key("lapsing")) <= LEFT_TTL_S
