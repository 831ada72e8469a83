"""The model registry lives in Redis only: a Redis killed with -9 and started again empty on its address
has lost every registered model, pinned ones included. The gateway puts back the entries of its last
view (the real gateway app on a real port, a real redis-server); entries the new server has are left as
they are (SET NX)."""

import time

import requests

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ModelSpec
from kvrelay.shared.wire.redis_conn import sync_client
from tests.e2e.restartable_redis import RestartableRedis
from tests.integration.gateway_harness import GatewayServer, gateway_config

BOUND_S = 60.0  # a hang bound, not a speed claim: the gateway's watch probes every 0.5 s


def _put(r, spec: ModelSpec) -> None:
    r.set(keys.registry_key(spec.name), encode(spec))
    r.sadd(keys.REGISTRY_INDEX, spec.name)


def _specs(r) -> dict[str, ModelSpec]:
    names = sorted(n.decode() for n in r.smembers(keys.REGISTRY_INDEX))
    return {n: decode(raw, ModelSpec) for n, raw in zip(names, r.mget([keys.registry_key(n) for n in names]),
                                                         strict=True) if raw is not None}


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {BOUND_S} s"
        time.sleep(0.05)


def test_registered_models_come_back_into_an_empty_redis():
    redis = RestartableRedis()
    redis.start()
    # no reconciler: only the reads this test makes refresh the gateway's view of the registry
    server = GatewayServer(gateway_config(redis.url, reconcile_interval_s=0.0)).start()
    r = sync_client(redis.url)
    try:
        pinned = ModelSpec(name="big", version=3, pinned=True, min_replicas=1, keep_alive_s=600.0, updated=1.0)
        lazy = ModelSpec(name="lazy", version=1, updated=1.0)
        _put(r, pinned)
        _put(r, lazy)
        assert requests.get(f"{server.url}/ready", timeout=10).status_code == 503  # reads the registry
        redis.kill()
        _until(lambda: requests.get(f"{server.url}/health", timeout=10).status_code == 503, "/health 503")
        redis.start()  # empty, same address and password
        _until(lambda: set(_specs(r)) == {"big", "lazy"}, "the registry re-published")
        assert _specs(r) == {"big": pinned, "lazy": lazy}
        _until(lambda: requests.get(f"{server.url}/health", timeout=10).status_code == 200, "/health 200")

        # A Redis restored from its file keeps its own entries (SET NX, never an overwrite of newer state),
        # and gets back those it lacks. Changed through another gateway after this one's last read:
        requests.get(f"{server.url}/ready", timeout=10)  # this gateway's view: big v3, lazy
        swapped = ModelSpec(name="big", version=4, pinned=True, updated=2.0)
        _put(r, swapped)
        r.delete(keys.registry_key("lazy"))
        r.srem(keys.REGISTRY_INDEX, "lazy")
        redis.save()
        redis.kill()
        redis.start(keep_data=True)
        _until(lambda: "lazy" in _specs(r), "the entry the restored Redis lacks, re-published")
        assert _specs(r) == {"big": swapped, "lazy": lazy}
    finally:
        server.stop()
        r.close()
        redis.stop()
