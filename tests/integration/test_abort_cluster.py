"""Aborts on a real Redis Cluster: a gateway publishes on ``ABORT_CHANNEL`` (its asyncio cluster client,
through whichever node it picked) and a worker's listener (its sync cluster client, subscribed on the
channel's node) hears it, since a cluster carries PUBLISH to every node; each as its role's ACL user."""

import asyncio
import threading
import time

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import Abort
from kvrelay.shared.wire.redis_conn import async_client, sync_client
from kvrelay.shared.worker.abort_listener import AbortListener


def test_a_gateways_abort_reaches_a_worker_on_the_cluster(redis_cluster):
    worker = sync_client(redis_cluster.role_url("worker"))
    listener = AbortListener(worker)
    stop = threading.Event()
    thread = threading.Thread(target=listener.run, args=(stop,), daemon=True)
    thread.start()

    async def publish_until_heard() -> list[str]:
        gateway = async_client(redis_cluster.role_url("gateway"))
        heard: list[str] = []
        try:
            deadline = time.monotonic() + 10  # the listener subscribes in its own time: publish until heard
            while "r1" not in heard:
                assert time.monotonic() < deadline, "no abort heard"
                await gateway.publish(keys.ABORT_CHANNEL, encode(Abort(request_ids=["r1", "r2"], reason="test")))
                await asyncio.sleep(0.2)
                heard += listener.drain()
        finally:
            await gateway.aclose()
        return heard

    try:
        heard = asyncio.run(publish_until_heard())
        assert {"r1", "r2"} <= set(heard)
    finally:
        stop.set()
        thread.join(5)
        worker.close()
