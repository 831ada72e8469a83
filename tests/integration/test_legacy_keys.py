"""Upgrading a durable single Redis from before the hash tags (shared/wire/legacy_keys.py): a real gateway
process, started on a real redis-server holding the old names, moves its tenants, API keys and model
registry to today's names, so an API key issued before the upgrade still works and the registry still
lists its model; the move is atomic per batch, idempotent, and what the new names hold wins. It runs as
the gateway's least-privilege user."""

import asyncio
import hashlib
import json
import time
import urllib.error
import urllib.request

import pytest
import redis

from kvrelay.shared.wire import legacy_keys
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ModelSpec
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, async_client, sync_client
from tests.e2e.cluster import Cluster

P = keys.PREFIX
OLD_KEY = "kvr-issued-before-the-upgrade-0123456789"
ADMIN_KEY = "admin-key-for-legacy-key-tests-0123"


@pytest.fixture()
def embedded():
    server = EmbeddedRedis()
    server.start()
    yield server
    server.stop()


def _write_old(r: redis.Redis) -> None:
    digest = hashlib.sha256(OLD_KEY.encode()).hexdigest()
    r.hset(f"{P}:tenant:acme", mapping={"models": "[]", "quota_period_s": 86400, "priority": 0,
                                        "cache_salt": "ab" * 16, "created": "1.0"})
    r.sadd(f"{P}:tenants", "acme")
    r.hset(f"{P}:apikey:{digest}", mapping={"id": "key-1", "tenant": "acme", "digest": digest, "created": "1.0"})
    r.hset(f"{P}:apikeys", "key-1", digest)
    r.set(f"{P}:registry:old", encode(ModelSpec(name="old", version=1)))
    r.sadd(f"{P}:registry", "old")
    r.set(f"{P}:worker:gone", b"x")
    r.sadd(f"{P}:workers", "gone")
    r.set(f"{P}:model:gone", b"x")
    r.sadd(f"{P}:models", "gone")


def _get(port: int, path: str, key: str) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:  # not listening yet
        return 0, {}


def test_a_gateway_moves_the_old_names_and_old_api_keys_keep_working(embedded, tmp_path):
    r = sync_client(embedded.url)
    _write_old(r)
    c = Cluster(embedded.role_url("gateway"), "", [], tmp_path)
    c.start_gateway(extra=["--admin-key", ADMIN_KEY])
    try:
        deadline = time.monotonic() + 60
        while (status := _get(c.port, "/v1/models", OLD_KEY)[0]) != 200:
            assert time.monotonic() < deadline, (status, c.log("gateway")[-2000:])
            time.sleep(0.3)
        status, body = _get(c.port, "/admin/models", ADMIN_KEY)
        assert status == 200 and [m["name"] for m in body["data"]] == ["old"], body
        assert r.hget(keys.tenant_key("acme"), "cache_salt") == b"ab" * 16
        assert r.smembers(keys.TENANTS_INDEX) == {b"acme"} and r.smembers(keys.REGISTRY_INDEX) == {b"old"}
        old = [f"{P}:tenant:acme", f"{P}:tenants", f"{P}:apikeys", f"{P}:registry", f"{P}:registry:old",
               f"{P}:workers", f"{P}:worker:gone", f"{P}:models", f"{P}:model:gone"]
        assert not r.exists(*old)
        assert "moved 10 Redis key(s)" in c.log("gateway")
    finally:
        c.stop()
        c.redis.close()
        r.close()


def test_the_move_is_idempotent_and_the_new_names_win(embedded):
    r = sync_client(embedded.url)
    _write_old(r)
    r.hset(keys.tenant_key("acme"), "priority", 5)  # written by a process of this version meanwhile
    r.set(keys.registry_key("old"), b"newer")

    async def run() -> list[int]:
        client = async_client(embedded.role_url("gateway"))
        try:
            return [await legacy_keys.migrate(client), await legacy_keys.migrate(client)]
        finally:
            await client.aclose()

    try:
        assert asyncio.run(run()) == [10, 0]
        assert r.hget(keys.tenant_key("acme"), "priority") == b"5"
        assert r.hget(keys.tenant_key("acme"), "cache_salt") == b"ab" * 16
        assert r.get(keys.registry_key("old")) == b"newer"
    finally:
        r.close()
