"""The ACL rules cover every key family of redis_keys.py, and a worker's reach none of the gateway's own
(tenants, API keys, limits, usage, cached responses): a key family added without a decision here fails.
Redis URLs: TLS options are checked where they are given, and a password never reaches a printed line."""

import inspect
import subprocess
import sys
from fnmatch import fnmatchcase

import pytest
from pydantic import TypeAdapter, ValidationError

from kvrelay.shared.config.declare import RedisUrl
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV
from kvrelay.shared.wire import redis_acl
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redacted_url import redact
from kvrelay.shared.wire.redis_conn import async_client
from tests.zmq_secret import SECRET

# every key a worker touches, by the name redis_keys.py gives its family
WORKER_FAMILIES = {"prefill_stream", "prefill_band_stream", "prefill_worker_stream", "dead_letter_stream", "worker_key", "WORKERS_INDEX",
                   "model_key", "MODELS_INDEX", "registry_key", "REGISTRY_INDEX", "control_key", "control_result_key",
                   "gateway_key", "METRICS_SALT", "rerun_key"}
GATEWAY_ONLY = {"tenant_key", "api_key_key", "limit_key", "usage_key", "usage_models_key", "response_cache_key",
                "load_lock_key", "TENANTS_INDEX", "API_KEYS_INDEX", "USAGE_TENANTS", "RECONCILE_LOCK"}
NOT_KEYS = {"PREFIX", "PREFILL_GROUP", "JOB_FIELD", "ABORT_CHANNEL"}  # a prefix, a group, a field, a channel


def _families() -> dict[str, list[str]]:
    """Each key family with sample keys: names with ':' and '*' in them, as a tenant or model may have."""
    out = {}
    for name, value in vars(keys).items():
        if name.startswith("_") or name in NOT_KEYS:
            continue
        if isinstance(value, str):
            out[name] = [value]
        elif inspect.isfunction(value) and value.__module__ == keys.__name__:
            n = len(inspect.signature(value).parameters)
            out[name] = [value(*args) for args in ([s] * n for s in ("m", "a:b", "x*", "kvrelay:tenant:t"))]
    return out


def _matches(role: str, key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in redis_acl.KEYS[role])


def test_every_key_family_is_classified():
    assert set(_families()) == WORKER_FAMILIES | GATEWAY_ONLY


@pytest.mark.parametrize("family", sorted(WORKER_FAMILIES | GATEWAY_ONLY))
def test_a_worker_reaches_its_families_only_and_the_gateway_all(family):
    for key in _families()[family]:
        assert _matches("gateway", key), key
        assert _matches("worker", key) == (family in WORKER_FAMILIES), key


def test_no_role_may_run_an_administrative_command():
    for role in redis_acl.ROLES:
        granted = set(redis_acl.COMMANDS[role])
        assert not granted & {"config", "debug", "module", "acl", "shutdown", "replicaof", "slaveof", "flushall",
                              "flushdb", "keys", "script", "client", "migrate", "save", "bgsave"}
        assert redis_acl.rules(role).split()[0] == "resetkeys" and "-@all" in redis_acl.rules(role)
    # a worker never writes what only the gateway writes
    assert not {"hset", "hsetnx", "hincrby", "publish", "lpush"} & set(redis_acl.COMMANDS["worker"])


def test_the_aclfile_holds_hashes_and_switches_the_default_user_off():
    text = redis_acl.aclfile({"gateway": "g" * 20, "worker": "w" * 20})
    assert "g" * 20 not in text and "w" * 20 not in text
    lines = text.splitlines()
    assert lines[0].startswith("user default off") and len(lines) == 3
    assert lines[2].startswith("user worker on resetpass #")


def test_kvrelay_redis_acl_prints_it_and_refuses_a_missing_password():
    env = {redis_acl.PASSWORD_ENV["gateway"]: "g" * 20, redis_acl.PASSWORD_ENV["worker"]: "w" * 20}
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "redis-acl"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == redis_acl.aclfile({"gateway": "g" * 20, "worker": "w" * 20})
    del env[redis_acl.PASSWORD_ENV["worker"]]
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "redis-acl"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "KVRELAY_REDIS_WORKER_PASSWORD" in out.stderr


def test_kvrelay_redis_acl_for_a_cluster_adds_the_replication_user_and_says_where_it_goes():
    """The file itself is what tests/redis_cluster_server.py loads on every node of the e2e cluster."""
    env = {redis_acl.PASSWORD_ENV["gateway"]: "g" * 20, redis_acl.PASSWORD_ENV["worker"]: "w" * 20}
    argv = [sys.executable, "-m", "kvrelay.cli", "redis-acl", "--cluster"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and redis_acl.REPLICA_PASSWORD_ENV in out.stderr and out.stderr.count("\n") == 1
    env[redis_acl.REPLICA_PASSWORD_ENV] = "r" * 20
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    passwords = {"gateway": "g" * 20, "worker": "w" * 20, redis_acl.REPLICA_USER: "r" * 20}
    assert out.returncode == 0 and out.stdout == redis_acl.cluster_aclfile(passwords)
    assert "r" * 20 not in out.stdout and out.stdout.splitlines()[-1].startswith("user replica on resetpass #")
    assert "masteruser replica" in out.stderr and "every node" in out.stderr
    # what redis-py's cluster client sends before any command: the slot map, the commands' key positions
    for role in redis_acl.ROLES:
        assert {"cluster|slots", "command", "asking"} <= set(redis_acl.COMMANDS[role])


@pytest.mark.parametrize("url, shown", [
    ("redis://worker:s3cret@h:6379/0", "redis://worker:***@h:6379/0"),
    ("rediss://:s3cret@h:6380/1?ssl_ca_certs=/ca.pem", "rediss://:***@h:6380/1?ssl_ca_certs=/ca.pem"),
    ("unix://default:s3cret@/tmp/r.sock", "unix://default:***@/tmp/r.sock"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis-cluster://gateway:s3cret@h1:7000,h2:7001", "redis-cluster://gateway:***@h1:7000,h2:7001"),
    ("redis://u:s3cret@[::1:6379", "<unparsable URL>"),
])
def test_redact_hides_the_password(url, shown):
    assert redact(url) == shown


def test_tls_options_are_checked_where_the_url_is_given(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    check = TypeAdapter(RedisUrl).validate_python
    assert check(f"rediss://u:p@h:6380/0?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    for url, says in [(f"rediss://h/0?ssl_ca_cert={ca}", "unknown URL parameter 'ssl_ca_cert'"),
                      (f"redis://h/0?ssl_ca_certs={ca}", "unknown URL parameter 'ssl_ca_certs'"),
                      ("rediss://h/0?ssl_ca_certs=/no/such.pem", "ssl_ca_certs: no file /no/such.pem"),
                      ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of none, optional, required")]:
        with pytest.raises(ValidationError, match=says):
            check(url)


def test_cluster_urls_are_checked_where_they_are_given(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    check = TypeAdapter(RedisUrl).validate_python
    assert check("redis-cluster://worker:pw@10.0.0.1:7000,10.0.0.2:7000,[::1]:7002")
    assert check(f"rediss-cluster://worker:pw@h:7000/0?ssl_ca_certs={ca}&ssl_check_hostname=false")
    for url, says in [("redis-cluster://h:7000,h2", "cluster node 'h2' is not HOST:PORT"),
                      ("redis-cluster://h:7000/2", "one database, 0"),
                      (f"redis-cluster://h:7000?ssl_ca_certs={ca}", "only rediss-cluster:// takes URL parameters"),
                      ("rediss-cluster://h:7000?ssl_ca_certs=/no/such.pem", "ssl_ca_certs: no file /no/such.pem"),
                      ("redis-sharded://h:7000", "must be a redis://"),
                      (f"rediss-cluster://h:7000?ssl_ca_path={tmp_path}", "takes ssl_ca_certs")]:
        with pytest.raises(ValidationError, match=says):
            check(url)


def test_a_tls_cluster_url_reaches_every_nodes_connection(tmp_path):
    """The options go to each node's connection (made as the client discovers the nodes), as TLS ones."""
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    client = async_client(f"rediss-cluster://gateway:p%40ss@h1:7000,h2:7001?ssl_ca_certs={ca}&ssl_check_hostname=false")
    made = client.nodes_manager.connection_kwargs
    assert made["connection_class"].__name__ == "SSLConnection" and made["ssl_ca_certs"] == str(ca)
    assert made["ssl_check_hostname"] is False and made["username"] == "gateway" and made["password"] == "p@ss"
    assert [(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()] == [("h1", 7000), ("h2", 7001)]


def test_a_bad_redis_url_flag_is_one_line_without_the_password():
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "gateway", "--redis-url",
                          "rediss://gateway:s3cret-pw@h:6380/0?ssl_ca_certs=/no/such.pem", "--print-config"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "argument --redis-url: ssl_ca_certs: no file" in out.stderr and "s3cret-pw" not in out.stderr


def test_the_url_comes_from_the_environment_and_is_printed_redacted():
    env = {"PATH": "/usr/bin:/bin", "KVRELAY_REDIS_URL": "redis://gateway:s3cret-pw@redis:6379/0",
           ZMQ_SECRET_ENV: SECRET}
    for argv in (["gateway", "--print-config"], ["gateway", "--help"],
                 ["serve", "--model", "dummy:tiny-llama", "--print-config"]):  # serve: every child's config
        out = subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "redis://gateway:***@redis:6379/0" in out.stdout and "s3cret-pw" not in out.stdout + out.stderr
        assert out.stdout.count("redis://gateway:***@") == (3 if argv[0] == "serve" else 1)


def test_kvrelay_redis_acl_prints_a_sentinel_deployments_users_and_conf_lines():
    env = {redis_acl.PASSWORD_ENV["gateway"]: "g" * 20, redis_acl.PASSWORD_ENV["worker"]: "w" * 20,
           redis_acl.HA_PASSWORD_ENV["replica"]: "r" * 20, redis_acl.HA_PASSWORD_ENV["sentinel"]: "s" * 20}

    def run(*argv: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvrelay.cli", "redis-acl", *argv], env={**env, **extra},
                              capture_output=True, text=True)

    out = run("--sentinel", "kvrelay")
    assert out.returncode == 0 and out.stdout == redis_acl.aclfile(
        {"gateway": "g" * 20, "worker": "w" * 20, "replica": "r" * 20, "sentinel": "s" * 20}, sentinel=True)
    users = [line.split()[1] for line in out.stdout.splitlines()]
    assert users == ["default", "gateway", "worker", "replica", "sentinel"] and "r" * 20 not in out.stdout
    assert "+replconf" in out.stdout and "+slaveof" in out.stdout and "~" not in out.stdout.splitlines()[-1]
    assert run("--sentinel", "kvrelay", "--print", "redis.conf").stdout == f"masteruser replica\nmasterauth {'r' * 20}\n"
    assert run("--sentinel", "kvrelay", "--print", "sentinel.conf").stdout == (
        f"sentinel auth-user kvrelay sentinel\nsentinel auth-pass kvrelay {'s' * 20}\n")
    out = run("--sentinel", "kvrelay", "--print", "sentinel.conf", **{redis_acl.SENTINEL_CLIENT_PASSWORD_ENV: "c" * 20})
    assert out.stdout.splitlines()[2:] == [f"requirepass {'c' * 20}", f"sentinel sentinel-pass {'c' * 20}"]
    for argv, says in [(("--print", "sentinel.conf"), "--print sentinel.conf: only with --sentinel"),
                       (("--sentinel", "kvrelay", "--print", "sentinel.conf"), "KVRELAY_REDIS_SENTINEL_PASSWORD")]:
        out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "redis-acl", *argv],
                             env={k: v for k, v in env.items() if "SENTINEL" not in k}, capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
