"""Least privilege in Redis: the ACL user of each role, written once here for the embedded Redis
(``EmbeddedRedis``) and an external one (``kvrelay redis-acl`` prints an aclfile).

The gateway owns tenants, API keys, limits, usage and the response cache, and does what the admin API
does; a worker only reaches the key families it uses (``WORKER_KEYS``), so stolen worker credentials
cannot mint an API key, create a tenant or read a tenant's ``cache_salt``. Neither role may run an
administrative command (CONFIG, DEBUG, MODULE, ACL, SHUTDOWN, REPLICAOF, FLUSHALL, KEYS, ...). Rules need
Redis >= 6.2 (channel patterns); Lua scripts are held to the same rules, command by command, key by key.
``tests/unit/test_redis_acl.py`` checks every key family of ``redis_keys.py`` against these patterns.
"""

import hashlib

from kvrelay.shared.wire import redis_keys as keys

ROLES = ("gateway", "worker")
# ``kvrelay redis-acl`` reads each user's password from here, so it never sits in argv
PASSWORD_ENV = {"gateway": "KVRELAY_REDIS_GATEWAY_PASSWORD", "worker": "KVRELAY_REDIS_WORKER_PASSWORD"}
ROLE_OF_COMMAND = {"gateway": "gateway", "prefill-worker": "worker", "decode-worker": "worker",
                   "unified-worker": "worker"}

# What every client sends: redis-py's housekeeping (SELECT for a db in the URL, EVALSHA falling back to
# SCRIPT LOAD, WATCH/MULTI/EXEC for transactions) and INFO, whose run_id tells a restarted Redis apart.
_COMMON = ("ping", "select", "info", "time", "multi", "exec", "discard", "watch", "unwatch",
           "eval", "evalsha", "script|load", "script|exists")
COMMANDS = {
    "gateway": _COMMON + ("get", "set", "mget", "del", "exists", "expire",
                          "hget", "hgetall", "hset", "hsetnx", "hdel", "hincrby", "hkeys", "hexists",
                          "sadd", "srem", "smembers", "scard", "lpush",
                          "xadd", "xlen", "xrange", "xinfo", "xpending", "publish", "wait"),
    "worker": _COMMON + ("get", "set", "mget", "del", "exists", "sadd", "srem", "smembers", "brpop",
                         "xadd", "xlen", "xrange", "xreadgroup", "xack", "xdel", "xautoclaim", "xclaim",
                         "xgroup", "xinfo", "xpending", "subscribe", "unsubscribe"),
}

# Globs over redis_keys.py's names. A worker: the job streams (it reads, acks, dead-letters and moves
# jobs), its registration and its models', the registry (a worker registers the model it was started
# with), its control queue and results, the gateways' liveness keys, and the salt its /metrics hashes
# tenant names with (shared/wire/tenant_label.py: whichever process starts first sets it).
WORKER_KEYS = (keys.prefill_stream("*"), f"{keys.PREFIX}:prefill-worker:*", keys.dead_letter_stream("*"),
               keys.worker_key("*"), keys.WORKERS_INDEX, keys.model_key("*"), keys.MODELS_INDEX,
               keys.registry_key("*"), keys.REGISTRY_INDEX, keys.control_key("*"), keys.control_result_key("*"),
               keys.gateway_key("*"), keys.METRICS_SALT)
KEYS = {"gateway": (f"{keys.PREFIX}:*",), "worker": WORKER_KEYS}
CHANNELS = {"gateway": (keys.ABORT_CHANNEL,), "worker": (keys.ABORT_CHANNEL,)}


# A Sentinel deployment's own users on the data servers (which do not replicate ACLs: every data server
# gets every user). The replica's replication link (masteruser/masterauth), and the sentinels' (they
# watch the servers, announce themselves on the hello channel and, at a failover, promote a replica and
# repoint the others), with the commands Redis's Sentinel documentation lists for each and no keys.
HA_USERS = ("replica", "sentinel")
HA_PASSWORD_ENV = {"replica": "KVRELAY_REDIS_REPLICA_PASSWORD", "sentinel": "KVRELAY_REDIS_SENTINEL_PASSWORD"}
# the password clients give the sentinels themselves (sentinel.conf's requirepass; the URL's sentinel_password)
SENTINEL_CLIENT_PASSWORD_ENV = "KVRELAY_SENTINEL_PASSWORD"
_HA_RULES = {
    "replica": "resetkeys resetchannels -@all +psync +replconf +ping",
    "sentinel": "resetkeys allchannels -@all +multi +slaveof +ping +exec +subscribe +config|rewrite +role +publish "
                "+info +client|setname +client|kill +script|kill",
}


def rules(role: str) -> str:
    """The role's ACL rules after ``user NAME on <password>``: nothing but what is listed."""
    if role in _HA_RULES:
        return _HA_RULES[role]
    return " ".join(["resetkeys", *(f"~{k}" for k in KEYS[role]), "resetchannels", *(f"&{c}" for c in CHANNELS[role]),
                     "-@all", *(f"+{c}" for c in COMMANDS[role])])


def user_line(role: str, password: str, hashed: bool = False) -> str:
    """One ``user`` line of an aclfile or redis.conf; ``hashed`` writes the password's SHA-256 (``#hex``),
    so the file holds no password."""
    secret = f"#{hashlib.sha256(password.encode()).hexdigest()}" if hashed else f">{password}"
    return f"user {role} on resetpass {secret} {rules(role)}"


def aclfile(passwords: dict[str, str], sentinel: bool = False) -> str:
    """An aclfile for an external Redis: the roles' users, and ``default`` switched off (every client
    must name its user); with ``sentinel``, the replica's and the sentinels' users too (``HA_USERS``)."""
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    lines += [user_line(role, passwords[role], hashed=True) for role in (*ROLES, *(HA_USERS if sentinel else ()))]
    return "\n".join(lines) + "\n"


def replica_conf(replica_password: str) -> list[str]:
    """redis.conf lines of every data server of a Sentinel deployment (any of them may become a replica)."""
    return ["masteruser replica", f"masterauth {replica_password}"]


def sentinel_conf(master: str, sentinel_password: str, client_password: str | None = None) -> list[str]:
    """sentinel.conf lines: how the sentinels log in to the data servers and, with ``client_password``,
    the password they ask of their clients and of each other (a Sentinel URL's ``sentinel_password``)."""
    lines = [f"sentinel auth-user {master} sentinel", f"sentinel auth-pass {master} {sentinel_password}"]
    if client_password:
        lines += [f"requirepass {client_password}", f"sentinel sentinel-pass {client_password}"]
    return lines
