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
# In a Redis Cluster, redis-py reads the slot map (CLUSTER SLOTS), the commands' key positions (COMMAND,
# to route each command to its slot's node) and follows ASK redirections while a slot migrates; on a
# single Redis these are never sent, and they reveal nothing but the cluster's layout.
_COMMON = ("ping", "select", "info", "time", "multi", "exec", "discard", "watch", "unwatch",
           "eval", "evalsha", "script|load", "script|exists", "cluster|slots", "command", "asking")
COMMANDS = {
    "gateway": _COMMON + ("get", "set", "mget", "del", "exists", "expire", "ttl",
                          "hget", "hgetall", "hset", "hsetnx", "hdel", "hincrby", "hkeys", "hexists",
                          "sadd", "srem", "smembers", "scard", "lpush",
                          "xadd", "xlen", "xrange", "xinfo", "xpending", "publish", "wait"),
    "worker": _COMMON + ("get", "set", "mget", "del", "exists", "expire", "sadd", "srem", "smembers", "brpop",
                         "xadd", "xlen", "xrange", "xreadgroup", "xack", "xdel", "xautoclaim", "xclaim",
                         "xgroup", "xinfo", "xpending", "subscribe", "unsubscribe"),
}

# Globs over redis_keys.py's names. A worker: the job streams (it reads, acks, dead-letters and moves
# jobs), its registration and its models', the registry (a worker registers the model it was started
# with), its control queue and results, the gateways' liveness keys, the salt its /metrics hashes
# tenant names with (shared/wire/tenant_label.py: whichever process starts first sets it), and the claims
# that decide who re-runs a job its decode worker died holding (shared/wire/rerun.py).
WORKER_KEYS = (f"{keys.PREFIX}:prefill:*", f"{keys.PREFIX}:prefill-worker:*", f"{keys.PREFIX}:deadletter:*",
               keys.worker_key("*"), keys.WORKERS_INDEX, keys.model_key("*"), keys.MODELS_INDEX,
               keys.registry_key("*"), keys.REGISTRY_INDEX, keys.control_key("*"), keys.control_result_key("*"),
               keys.gateway_key("*"), keys.METRICS_SALT, keys.rerun_key("*", "*"))
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


# Redis Cluster: ACL users are each node's own (the cluster bus shares slots, not users), so every node,
# replicas included, loads the same aclfile. With ``default`` off, a replica syncs from its master as the
# Sentinel deployment's replica user (``masteruser``/``masterauth`` in each node's redis.conf).
REPLICA_USER = "replica"
REPLICA_PASSWORD_ENV = HA_PASSWORD_ENV[REPLICA_USER]


def cluster_aclfile(passwords: dict[str, str]) -> str:
    """``aclfile`` plus the replication user, for every node of a Redis Cluster."""
    return aclfile(passwords) + user_line(REPLICA_USER, passwords[REPLICA_USER], hashed=True) + "\n"


def cluster_instructions(aclfile_path: str = "/etc/redis/users.acl") -> str:
    """What each node's redis.conf needs beside the aclfile (said on stderr: stdout is the file)."""
    return (f"Load this same file on every node of the cluster, masters and replicas: in each redis.conf\n"
            f"  aclfile {aclfile_path}\n  masteruser {REPLICA_USER}\n  masterauth <${REPLICA_PASSWORD_ENV}>\n"
            f"(or ACL LOAD on each node after changing it: nodes do not share users). Clients list any nodes:\n"
            f"  redis-cluster://gateway:<password>@HOST:PORT,HOST:PORT,HOST:PORT\n")
