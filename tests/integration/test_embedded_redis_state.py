"""The embedded Redis with a state folder (``kvrelay serve --state-dir``), on a real redis-server: what was
written survives a ``kill -9`` of the server (started again with ``spawn``, as serve's supervisor does)
and a stop and start on the same folder, at the same URLs with the same passwords, so clients started
before keep working; its files are private. Without a folder nothing is kept (tests' throwaway servers)."""

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest
import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import AOF_NAME, PASSWORDS_NAME, EmbeddedRedis, sync_client


def _folder(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)  # what kvrelay/state_dir.py hands over
    return state


def _write(client: redis.Redis) -> dict:
    """One key of each kind kvrelay keeps (a tenant's hash, an index set, a counter, a job stream);
    returns what reading them back must give."""
    client.hset(f"{keys.PREFIX}:tenant:acme", mapping={"name": "acme", "rpm": "60"})
    client.sadd(f"{keys.PREFIX}:tenants", "acme", "globex")
    client.incrby(f"{keys.PREFIX}:usage:acme", 12345)
    client.xadd(f"{keys.PREFIX}:stream:tiny", {"job": b"\x00\x01payload"})
    return _read(client)


def _until_in_file(state_dir: Path) -> None:
    """Until the append-only file holds the last write of ``_write``. Under ``appendfsync everysec`` Redis
    appends a write to the file before it replies, except while an fsync is still running (a busy disk): then
    it replies and postpones the append by up to 2 s, the second of writes everysec may lose to a kill -9."""
    aof = state_dir / AOF_NAME
    deadline = time.monotonic() + 10
    while not (aof.exists() and b"\x00\x01payload" in aof.read_bytes()):
        assert time.monotonic() < deadline, "the last write never reached the append-only file"
        time.sleep(0.05)


def _read(client: redis.Redis) -> dict:
    return {"tenant": client.hgetall(f"{keys.PREFIX}:tenant:acme"),
            "index": client.smembers(f"{keys.PREFIX}:tenants"),
            "usage": client.get(f"{keys.PREFIX}:usage:acme"),
            "jobs": [fields for _id, fields in client.xrange(f"{keys.PREFIX}:stream:tiny")]}


def test_a_server_killed_with_9_comes_back_from_its_file_at_the_same_address(tmp_path):
    server = EmbeddedRedis(state_dir=_folder(tmp_path))
    url = server.start()
    try:
        gateway_url = server.role_url("gateway")
        client = sync_client(url)
        written = _write(client)
        assert written["usage"] == b"12345" and len(written["jobs"]) == 1
        _until_in_file(server.state_dir)
        killed = server.process
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
        with pytest.raises(redis.ConnectionError):
            sync_client(url).ping()

        server.spawn()
        assert server.wait_ready()
        assert server.pid != killed.pid
        assert _read(client) == written  # the same client object: it reconnects to the same URL
        assert sync_client(gateway_url).hget(f"{keys.PREFIX}:tenant:acme", "rpm") == b"60"  # same passwords
    finally:
        server.stop()


def test_a_folder_too_deep_for_a_unix_socket_puts_the_socket_in_a_short_private_one(tmp_path):
    deep = tmp_path / ("x" * max(1, 120 - len(str(tmp_path))))
    deep.mkdir(mode=0o700)
    server = EmbeddedRedis(state_dir=deep)
    url = server.start()
    try:
        sock = Path(url.rsplit("@", 1)[1])
        assert sock.parent != deep and len(os.fsencode(sock)) <= 107
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        client = sync_client(url)
        written = _write(client)
        _until_in_file(deep)
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait(10)
        server.spawn()  # the supervisor's restart: the same socket
        assert server.wait_ready() and _read(client) == written
    finally:
        server.stop()
    assert not sock.parent.exists()


def test_stop_and_start_on_the_same_folder_keeps_data_urls_and_passwords(tmp_path):
    state = _folder(tmp_path)
    first = EmbeddedRedis(state_dir=state)
    url = first.start()
    roles = {role: first.role_url(role) for role in ("gateway", "worker")}
    written = _write(sync_client(url))
    first.stop()  # SIGTERM: redis-server fsyncs its file and exits

    assert state.is_dir()  # kept, unlike a throwaway server's temp dir
    for name in (PASSWORDS_NAME, "redis.conf"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    assert (state / "appendonly.aof").stat().st_size > 0
    assert set(json.loads((state / PASSWORDS_NAME).read_text())) == {"default", "gateway", "worker"}

    second = EmbeddedRedis(state_dir=state)
    try:
        assert second.start() == url
        assert {role: second.role_url(role) for role in roles} == roles
        assert _read(sync_client(url)) == written
        worker = sync_client(roles["worker"])
        assert worker.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):  # still the worker's least privilege
            worker.hgetall(f"{keys.PREFIX}:tenant:acme")
    finally:
        second.stop()


def test_a_passwords_file_that_is_not_ours_is_refused_not_replaced(tmp_path):
    state = _folder(tmp_path)
    (state / PASSWORDS_NAME).write_text("not json")
    with pytest.raises(ValueError, match=rf"{PASSWORDS_NAME}: unreadable .*delete it to make new passwords"):
        EmbeddedRedis(state_dir=state).start()
    assert (state / PASSWORDS_NAME).read_text() == "not json"


def test_without_a_folder_nothing_is_kept():
    server = EmbeddedRedis()
    url = server.start()
    folder = Path(server.process.args[1]).parent  # its config's folder, a temp dir
    sync_client(url).set(f"{keys.PREFIX}:x", 1)
    server.stop()
    assert not folder.exists()
    again = EmbeddedRedis()
    try:
        assert again.start() != url  # new port, new passwords
        assert sync_client(again.url).get(f"{keys.PREFIX}:x") is None
    finally:
        again.stop()
