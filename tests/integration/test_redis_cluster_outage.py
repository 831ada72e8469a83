"""A Redis Cluster that no node of answers is an outage as a single Redis's refused connection is: a
ConnectionError (a RedisError), from the sync and the asyncio client, from one made before and one made
during the outage, which the outage handling (``redis_health.py``) takes in; redis-py's own
RedisClusterException is no RedisError and would pass every ``except redis.RedisError``. When the nodes
are back, the clients made before work again."""

import asyncio
import logging
import time

import pytest
import redis

from kvrelay.shared.wire.redis_conn import async_client, sync_client
from kvrelay.shared.wire.redis_health import RedisHealth


def test_a_cluster_that_is_down_is_a_connection_error(own_cluster):
    health = RedisHealth(logging.getLogger("test"))
    before = sync_client(own_cluster.url)
    loop = asyncio.new_event_loop()
    before_async = async_client(own_cluster.url)
    try:
        assert before.set("{t}k", 1) and loop.run_until_complete(before_async.get("{t}k")) == b"1"
        own_cluster.kill_all()
        for attempt in (lambda: before.get("{t}k"), lambda: loop.run_until_complete(before_async.get("{t}k")),
                        lambda: sync_client(own_cluster.url),
                        lambda: loop.run_until_complete(async_client(own_cluster.url).get("{t}k"))):
            # redis-py's "cannot be connected" made one, or its retries' last refused connection (which one
            # depends on when its retries give up): either way a ConnectionError
            with pytest.raises(redis.ConnectionError) as err:
                attempt()
            assert health.absorb(err.value) and not health.reachable
        own_cluster.restart_all()
        # the same clients, made before the outage, work again: each reads the slot map anew
        deadline = time.monotonic() + 30
        while True:
            try:
                assert before.set("{t}k", 2) and loop.run_until_complete(before_async.get("{t}k")) == b"2"
                break
            except redis.ConnectionError:  # a node may still be taking its peers back
                assert time.monotonic() < deadline, "the clients did not reconnect"
                time.sleep(0.2)
    finally:
        before.close()
        loop.run_until_complete(before_async.aclose())
        loop.close()
