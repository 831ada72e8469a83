"""A gateway of this version reading the heartbeats of workers of the next one, through the real gateway app and
real Redis: a newer WorkerInfo whose extra field is declared ignorable is served (and shown with its protocol
version in /admin/models), one with an unknown must-understand field, or a protocol more than one version
apart, is refused with one clear line, logged once per worker."""

import logging
import time
from collections.abc import Iterator

import msgpack
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import IGNORABLE_KEY, encode
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.version import PROTOCOL_VERSION
from tests.integration.model_pool_harness import Env, model_pool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("wire_upgrade")
    (tmp / "repo").mkdir()
    with model_pool(redis_url, tmp / "repo", tmp, db=14) as env:
        yield env


def _beat(env: Env, worker_id: str, ignorable: dict | None = None, **fields) -> None:
    """Publish the heartbeat a newer worker would: this version's fields, plus ``fields`` (unknown ones among
    them), with ``ignorable`` added and declared so."""
    info = WorkerInfo(worker_id=worker_id, role="decode", models=["m"], zmq_addr="tcp://127.0.0.1:1", free_blocks=8,
                      total_blocks=8, running=0, waiting=0, pid=1, host="new-host", started=time.time(),
                      heartbeat=time.time())
    raw = {**msgpack.unpackb(encode(info)), **fields, **(ignorable or {})}
    if ignorable:
        raw[IGNORABLE_KEY] = [*raw.get(IGNORABLE_KEY, []), *ignorable]
    r = sync_client(env.redis_url)
    r.set(keys.worker_key(worker_id), msgpack.packb(raw, use_bin_type=True), ex=keys.HEARTBEAT_TTL_S)
    r.sadd(keys.WORKERS_INDEX, worker_id)
    r.close()


def _listing(env: Env) -> dict:
    r = env.admin("GET", "/admin/models")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_newer_heartbeat_with_an_ignorable_field_is_served_and_shown(env):
    _beat(env, "w-next", ignorable={"gpu_temperature_c": 61.5}, protocol=PROTOCOL_VERSION + 1)
    listing = _listing(env)
    assert listing["protocol"] == PROTOCOL_VERSION
    (row,) = [w for w in listing["workers"] if w["worker_id"] == "w-next"]
    assert row["protocol"] == PROTOCOL_VERSION + 1
    assert "w-next" not in listing["refused_workers"]


def test_a_newer_heartbeat_with_a_must_understand_field_is_refused_once_with_a_clear_line(env, caplog):
    _beat(env, "w-strict", kv_partition="mig-3g")
    with caplog.at_level(logging.WARNING, logger="kvrelay.gateway"):
        for _ in range(2):
            listing = _listing(env)
    assert "w-strict" not in [w["worker_id"] for w in listing["workers"]]
    why = listing["refused_workers"]["w-strict"]
    assert "unknown field(s) kv_partition that must be understood" in why and "newer wire protocol" in why
    assert [r.getMessage() for r in caplog.records if "w-strict" in r.getMessage()] == [why]


def test_a_worker_more_than_one_version_apart_is_refused(env):
    _beat(env, "w-far", protocol=PROTOCOL_VERSION + 2)
    listing = _listing(env)
    assert "w-far" not in [w["worker_id"] for w in listing["workers"]]
    assert listing["refused_workers"]["w-far"] == (
        f"worker 'w-far' speaks wire protocol {PROTOCOL_VERSION + 2}, this process {PROTOCOL_VERSION}: more than 1 "
        "version apart, refused (upgrade one version at a time)")
