"""Clients of a Redis master behind Sentinel (the ``redis+sentinel://`` URL: ``redis_sentinel.py``).

They are redis-py's (``redis.sentinel`` / ``redis.asyncio.sentinel``): every new connection asks
the sentinels where the master is, and a connection still open to a demoted master fails its next write
(READONLY) and is replaced. With the same retries and health checks as a plain client
(``redis_conn.py`` hands them in), a failover reads as an outage of a few seconds: commands fail (and
are retried) while no master is known, and succeed on the promoted one as soon as the sentinels name it.
"""

from __future__ import annotations

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff

from kvrelay.shared.wire.redis_sentinel import parse


def _no_master(sentinels: list, master: str) -> str:
    # redis-py's own message holds the repr of every sentinel client, hundreds of characters each
    where = ", ".join(f"{c.connection_pool.connection_kwargs.get('host')}:{c.connection_pool.connection_kwargs.get('port')}"
                      for c in sentinels)
    return f"no sentinel at {where} names a live master {master!r} (unreachable, or a failover in progress)"


class _Sentinel(redis.sentinel.Sentinel):
    def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            return super().discover_master(service_name)
        except redis.sentinel.MasterNotFoundError:
            raise redis.sentinel.MasterNotFoundError(_no_master(self.sentinels, service_name)) from None


class _AsyncSentinel(redis.asyncio.sentinel.Sentinel):
    async def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            return await super().discover_master(service_name)
        except redis.asyncio.sentinel.MasterNotFoundError:
            raise redis.asyncio.sentinel.MasterNotFoundError(_no_master(self.sentinels, service_name)) from None


class _BlockingSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool):
    """Sentinel's pool (connections to wherever the master is now) that waits for a free connection at its
    cap, as the plain async client's ``BlockingConnectionPool`` does, rather than raising."""


def sync_client(url: str, **client_kwargs) -> redis.Redis:
    """A client of the master; ``client_kwargs`` are the plain clients' (timeouts, retries, health checks)."""
    spec = parse(url)
    sentinel = _Sentinel(list(spec.sentinels),
                                       sentinel_kwargs=spec.sentinel_kwargs(redis.retry.Retry(NoBackoff(), 0)))
    return sentinel.master_for(spec.master, **client_kwargs, **spec.data_kwargs())


def async_client(url: str, max_connections: int, timeout: float, **client_kwargs) -> redis.asyncio.Redis:
    """An asyncio client of the master, a blocking pool of ``max_connections`` (``timeout``: the longest
    wait for one)."""
    spec = parse(url)
    sentinel = _AsyncSentinel(
        list(spec.sentinels), sentinel_kwargs=spec.sentinel_kwargs(redis.asyncio.retry.Retry(NoBackoff(), 0)))
    return sentinel.master_for(spec.master, connection_pool_class=_BlockingSentinelPool,
                               max_connections=max_connections, timeout=timeout, **client_kwargs,
                               **spec.data_kwargs())
