"""Redis Cluster clients: ``redis-cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]`` (``rediss-cluster://``
for TLS, with the query options a ``rediss://`` URL takes), through redis-py's RedisCluster, sync and
asyncio. The listed nodes are only where discovery starts: the client reads the slot map (CLUSTER
SLOTS) from the first that answers and follows MOVED/ASK redirections after a reshard or a failover.

Every key kvrelay writes carries a hash tag (``redis_keys.py``), so each transaction, Lua script and
multi-key command touches one slot; pipelines without MULTI may span slots (redis-py sends each node
its share). A cluster has one database, 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
import redis.retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisClusterException

SCHEMES = ("redis-cluster", "rediss-cluster")
# redis-py's cluster node pools do not queue a burst as the single-node BlockingConnectionPool does: past
# the cap a command fails at once ("Too many connections"). Each node's pool grows only with the
# commands in flight on it, so a high cap costs nothing when idle.
ASYNC_NODE_CONNECTIONS = 1024
_BOOL = {"true": True, "false": False}


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in SCHEMES


@dataclass
class ClusterUrl:
    nodes: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_options: dict[str, str | bool] = field(default_factory=dict)


def parse(url: str) -> ClusterUrl:
    """The nodes, credentials and TLS options of a cluster URL; ValueError saying what is wrong."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError("a cluster URL starts with redis-cluster:// or rediss-cluster://")
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")  # an IPv6 address: [::1]:7000
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster node {item!r} is not HOST:PORT")
        nodes.append((host, int(port)))
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a cluster has one database, 0 (the URL names {parts.path.lstrip('/')!r})")
    options: dict[str, str | bool] = {}
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        options[name] = _BOOL.get(values[-1].lower(), values[-1]) if name == "ssl_check_hostname" else values[-1]
    if options and scheme != "rediss-cluster":
        raise ValueError("only rediss-cluster:// takes URL parameters (TLS options)")
    return ClusterUrl(nodes, username, password, scheme == "rediss-cluster", options)


def _common(url: ClusterUrl, connect_timeout: float, reply_timeout: float) -> dict:
    kwargs: dict = {"username": url.username, "password": url.password, "decode_responses": False,
                    "socket_connect_timeout": connect_timeout, "socket_timeout": reply_timeout}
    if url.tls:
        kwargs |= {"ssl": True, **url.tls_options}
    return kwargs


def _unreachable(exc: RedisClusterException) -> redis.ConnectionError:
    return redis.ConnectionError(" ".join(str(exc).split()))


def _outage_is_a_connection_error(nodes_manager: redis.cluster.NodesManager) -> None:
    """redis-py says "Redis Cluster cannot be connected" (no node answers, so no slot map) with
    RedisClusterException, which is no RedisError: every command would raise it while the cluster is down,
    past each ``except redis.RedisError`` and the outage handling (``redis_health.py``) that a single
    Redis's refused connection goes through. The slot map is read in one place, at start and after a
    failed command; there it becomes the ConnectionError it is."""
    read = nodes_manager.initialize

    def initialize(*args, **kwargs):
        try:
            return read(*args, **kwargs)
        except RedisClusterException as exc:
            raise _unreachable(exc) from exc

    nodes_manager.initialize = initialize  # type: ignore[method-assign]


class _AsyncRedisCluster(redis.asyncio.cluster.RedisCluster):
    """The asyncio client reads the slot map at its first command and again after one failed on a broken
    connection, through ``initialize``: an unreachable cluster is a ConnectionError there too."""

    async def initialize(self, *args, **kwargs) -> redis.asyncio.cluster.RedisCluster:
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise _unreachable(exc) from exc


def sync_cluster_client(url: str, connect_timeout: float, reply_timeout: float, retries: int,
                        backoff: ExponentialWithJitterBackoff) -> redis.cluster.RedisCluster:
    """A RedisCluster: a command failing on a broken connection or a node that moved its slots is sent
    again (``retries`` times, with ``backoff``) after the client re-reads the slot map. It reads the map
    as it is made: an unreachable cluster raises ConnectionError here."""
    parsed = parse(url)
    try:
        client = redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in parsed.nodes],
            retry=redis.retry.Retry(backoff, retries), **_common(parsed, connect_timeout, reply_timeout))
    except RedisClusterException as exc:
        raise _unreachable(exc) from exc
    _outage_is_a_connection_error(client.nodes_manager)
    return client


def async_cluster_client(url: str, connect_timeout: float, reply_timeout: float, retries: int,
                         backoff: ExponentialWithJitterBackoff, health_check_s: float,
                         retry_on: tuple[type[Exception], ...]) -> redis.asyncio.cluster.RedisCluster:
    """Made without a round trip; the slot map is read at the first command."""
    parsed = parse(url)
    return _AsyncRedisCluster(
        startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in parsed.nodes],
        max_connections=ASYNC_NODE_CONNECTIONS, health_check_interval=health_check_s,
        retry=redis.asyncio.retry.Retry(backoff, retries), retry_on_error=list(retry_on),
        **_common(parsed, connect_timeout, reply_timeout))
