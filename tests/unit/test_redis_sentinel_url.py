"""``redis+sentinel://`` URLs: what they parse to, what a mistake in one says (one line, naming the flag,
before anything loads), that no password of theirs reaches a printed line, and the clients they make."""

import re
import subprocess
import sys

import pytest
import redis.asyncio.sentinel
import redis.sentinel
from pydantic import TypeAdapter, ValidationError

from kvrelay.shared.config.declare import RedisUrl
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV
from kvrelay.shared.wire import redis_conn, redis_sentinel
from kvrelay.shared.wire.redacted_url import redact
from tests.zmq_secret import SECRET


def test_the_parts_of_a_sentinel_url(tmp_path):
    spec = redis_sentinel.parse("redis+sentinel://gateway:p%40ss@s1:26380,s2,[::1]:26381/mymaster/3"
                                "?sentinel_password=spw&sentinel_username=su")
    assert spec.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert (spec.master, spec.db, spec.username, spec.password, spec.tls) == ("mymaster", 3, "gateway", "p@ss", False)
    assert spec.data_kwargs() == {"db": 3, "username": "gateway", "password": "p@ss"}
    sentinel = spec.sentinel_kwargs(retry=None)
    assert (sentinel["username"], sentinel["password"]) == ("su", "spw")
    bare = redis_sentinel.parse("redis+sentinel://h/m")
    assert (bare.sentinels, bare.db, bare.username, bare.password) == ((("h", 26379),), 0, None, None)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    tls = redis_sentinel.parse(f"rediss+sentinel://h:1/m?ssl_ca_certs={ca}&ssl_check_hostname=false")
    # the TLS options go to the data servers and to the sentinels alike, parsed as redis-py parses them
    assert tls.tls_kwargs() == {"ssl": True, "ssl_ca_certs": str(ca), "ssl_check_hostname": False}
    assert tls.sentinel_kwargs(retry=None)["ssl_ca_certs"] == str(ca) and tls.data_kwargs()["ssl"] is True


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h1:26379", "no master name"),
    ("redis+sentinel://h1:26379/", "no master name"),
    ("redis+sentinel://h1:port/m", "sentinel address 'h1:port': the port must be a number"),
    ("redis+sentinel://h1:26379,/m", "sentinel address '' has no host"),
    ("redis+sentinel://h1/m/zero", "only a database number may follow"),
    ("redis+sentinel://h1/m/0/x", "only a database number may follow"),
    ("redis+sentinel://h1/m?ssl_ca_certs=/ca.pem", "unknown URL parameter 'ssl_ca_certs'"),  # TLS: rediss+sentinel
    ("redis+sentinel://h1/m?sentinel_pasword=x", "unknown URL parameter 'sentinel_pasword'"),
    ("rediss+sentinel://h1/m?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of none, optional, required"),
    ("sentinel://h1/m", "must be a redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, redis-cluster:// or rediss-cluster:// URL"),
])
def test_a_bad_sentinel_url_says_what_is_wrong(url, says):
    with pytest.raises(ValidationError, match=re.escape(says)):
        TypeAdapter(RedisUrl).validate_python(url)


def test_good_sentinel_urls_are_accepted(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    check = TypeAdapter(RedisUrl).validate_python
    for url in ("redis+sentinel://u:p@h1:26379,h2:26379,h3:26379/kvrelay/0?sentinel_password=x",
                "redis+sentinel://h/kvrelay", f"rediss+sentinel://u:p@h:26379/kvrelay?ssl_ca_certs={ca}"
                "&sentinel_username=su&sentinel_password=sp"):
        assert check(url) == url


@pytest.mark.parametrize("url, shown", [
    ("redis+sentinel://gateway:s3cret@h1:26379,h2:26379/m/0",
     "redis+sentinel://gateway:***@h1:26379,h2:26379/m/0"),
    ("redis+sentinel://h1/m?sentinel_password=s3cret", "redis+sentinel://h1/m?sentinel_password=***"),
    ("rediss+sentinel://w:s3cret@h1/m?ssl_ca_certs=/ca.pem&sentinel_password=s3cret&sentinel_username=su",
     "rediss+sentinel://w:***@h1/m?ssl_ca_certs=/ca.pem&sentinel_password=***&sentinel_username=su"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_redact_hides_every_password_of_a_sentinel_url(url, shown):
    assert redact(url) == shown


def test_a_bad_sentinel_url_is_one_line_naming_the_flag_without_its_passwords():
    env = {"PATH": "/usr/bin:/bin", ZMQ_SECRET_ENV: SECRET,
           "KVRELAY_REDIS_URL": "redis+sentinel://gateway:s3cret-pw@h1:26379?sentinel_password=s3cret-spw"}
    for argv in (["gateway", "--print-config"], ["decode-worker", "--model", "dummy:tiny-llama", "--print-config"],
                 ["serve", "--model", "dummy:tiny-llama", "--print-config"]):
        out = subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv], env=env, capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "argument --redis-url: no master name" in out.stderr, out.stderr
        assert "s3cret" not in out.stderr + out.stdout


def test_a_good_sentinel_url_reaches_every_role_redacted():
    env = {"PATH": "/usr/bin:/bin", ZMQ_SECRET_ENV: SECRET,
           "KVRELAY_REDIS_URL": "redis+sentinel://gateway:s3cret-pw@h1:26379,h2:26379/kvrelay?sentinel_password=s3cret"}
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--model", "dummy:tiny-llama",
                          "--print-config"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shown = "redis+sentinel://gateway:***@h1:26379,h2:26379/kvrelay?sentinel_password=***"
    assert out.stdout.count(shown) == 3 and "s3cret" not in out.stdout + out.stderr  # gateway, prefill, decode


def test_sentinel_clients_have_the_plain_clients_resilience():
    url = "redis+sentinel://w:pw@127.0.0.1:1,127.0.0.1:2/kvrelay/2?sentinel_password=spw"
    client = redis_conn.sync_client(url)
    pool = client.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool) and pool.service_name == "kvrelay"
    kw = pool.connection_kwargs
    assert (kw["db"], kw["username"], kw["password"], kw["health_check_interval"]) == (2, "w", "pw", 1.0)
    assert kw["retry"].get_retries() == redis_conn.RETRIES and kw["socket_connect_timeout"] == redis_conn.CONNECT_TIMEOUT_S
    sentinels = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(s["host"], s["port"], s["password"]) for s in sentinels] == [("127.0.0.1", 1, "spw"), ("127.0.0.1", 2, "spw")]
    # nothing listens there: a clean, short error naming the master set, not a hang or a wall of reprs
    with pytest.raises(redis.ConnectionError, match=re.escape("no sentinel at 127.0.0.1:1, 127.0.0.1:2 names a live master 'kvrelay'")):
        client.ping()
    aclient = redis_conn.async_client(url, pool_size=7)
    apool = aclient.connection_pool
    assert isinstance(apool, redis.asyncio.sentinel.SentinelConnectionPool)
    assert isinstance(apool, redis.asyncio.BlockingConnectionPool) and apool.max_connections == 7
    assert apool.connection_kwargs["retry"].get_retries() == redis_conn.RETRIES
