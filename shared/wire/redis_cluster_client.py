"""Redis Cluster clients of a ``redis-cluster://`` / ``rediss-cluster://`` URL (``redis_cluster.py`` reads it),
through redis-py's RedisCluster, sync and asyncio. The listed nodes are only where discovery starts: the client reads the slot map (CLUSTER
SLOTS) from the first that answers and follows MOVED/ASK redirections after a reshard or a failover.

Every key kvrelay writes carries a hash tag (``redis_keys.py``), so each transaction, Lua script and
multi-key command touches one slot; pipelines without MULTI may span slots (redis-py sends each node
its share). A cluster has one database, 0.
"""

from __future__ import annotations

import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
import redis.retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterDownError, RedisClusterException

from kvrelay.shared.wire.redis_cluster import ClusterUrl, parse

# redis-py's cluster node pools do not queue a burst as the single-node BlockingConnectionPool does: past
# the cap a command fails at once ("Too many connections"). Each node's pool grows only with the
# commands in flight on it, so a high cap costs nothing when idle.
ASYNC_NODE_CONNECTIONS = 1024


def _common(url: ClusterUrl, connect_timeout: float, reply_timeout: float) -> dict:
    kwargs: dict = {"username": url.username, "password": url.password, "decode_responses": False,
                    "socket_connect_timeout": connect_timeout, "socket_timeout": reply_timeout}
    if url.tls:
        kwargs |= {"ssl": True, **url.tls_options}
    return kwargs


# Two ways redis-py says a cluster cannot serve that are no ConnectionError: "Redis Cluster cannot be
# connected" (no node answers, so no slot map: RedisClusterException, not even a RedisError) and
# CLUSTERDOWN (nodes answer, but not every slot is served: a master down without a replica, or the
# cluster still forming after a restart; ClusterDownError, a ResponseError). Both are outages, and the
# code that rides out a single Redis's outages (``redis_health.py``, the workers' loops, the gateway's
# 503) knows outages as ConnectionError: the clients here raise that, after redis-py's own retries.
_DOWN = (RedisClusterException, ClusterDownError)


def _unreachable(exc: Exception) -> redis.ConnectionError:
    return redis.ConnectionError(" ".join(str(exc).split()))


class _Unreachable:
    """Raises what its block raised of ``down`` as the ConnectionError of an unreachable Redis."""

    def __init__(self, down: type[Exception] | tuple[type[Exception], ...]) -> None:
        self.down = down

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if isinstance(exc, self.down):
            raise _unreachable(exc) from exc
        return False


_OUTAGE = _Unreachable(_DOWN)
_NO_SLOT_MAP = _Unreachable(RedisClusterException)


def _outage_is_a_connection_error(nodes_manager: redis.cluster.NodesManager) -> None:
    """The sync client reads the slot map in one place, at start and after a failed command."""
    read = nodes_manager.initialize

    def initialize(*args, **kwargs):
        with _NO_SLOT_MAP:
            return read(*args, **kwargs)

    nodes_manager.initialize = initialize  # type: ignore[method-assign]


class _SyncRedisCluster(redis.cluster.RedisCluster):
    def execute_command(self, *args, **kwargs):
        with _OUTAGE:
            return super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def guarded(*args, **kwargs):
            with _OUTAGE:
                return execute(*args, **kwargs)

        pipe.execute = guarded  # type: ignore[method-assign]
        return pipe


class _AsyncClusterPipeline(redis.asyncio.cluster.ClusterPipeline):
    async def execute(self, *args, **kwargs):
        with _OUTAGE:
            return await super().execute(*args, **kwargs)


class _AsyncRedisCluster(redis.asyncio.cluster.RedisCluster):
    """The asyncio client reads the slot map at its first command and again after one failed on a broken
    connection, through ``initialize``."""

    async def initialize(self, *args, **kwargs) -> redis.asyncio.cluster.RedisCluster:
        with _OUTAGE:
            return await super().initialize(*args, **kwargs)

    async def execute_command(self, *args, **kwargs):
        with _OUTAGE:
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None) -> _AsyncClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _AsyncClusterPipeline(self, transaction)


def sync_cluster_client(url: str, connect_timeout: float, reply_timeout: float, retries: int,
                        backoff: ExponentialWithJitterBackoff) -> redis.cluster.RedisCluster:
    """A RedisCluster: a command failing on a broken connection or a node that moved its slots is sent
    again (``retries`` times, with ``backoff``) after the client re-reads the slot map. It reads the map
    as it is made: an unreachable cluster raises ConnectionError here. redis-py's sync cluster client takes
    no health-check interval nor retry_on_error (its retry covers broken connections, with a new map)."""
    parsed = parse(url)
    with _NO_SLOT_MAP:
        client = _SyncRedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in parsed.nodes],
            retry=redis.retry.Retry(backoff, retries), **_common(parsed, connect_timeout, reply_timeout))
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
