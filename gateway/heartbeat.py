"""The gateway's liveness, for the workers: ``gateway_key(reply_addr)`` SET with EX=GATEWAY_TTL_S every
GATEWAY_HEARTBEAT_S, keyed by the ZMQ address its Jobs carry as ``reply_addr``. A worker whose in-flight
requests reply to an address whose key lapsed aborts them (shared/worker/gateway_watch.py), so a gateway
killed with -9 leaves no request decoding for nobody.

The first beat lands before the gateway serves (this context starts before the site does) and the last
after its drain (contexts close after it); a clean shutdown deletes the key, so workers need not wait
for its TTL to free what a drain timeout left behind. When Redis comes back (or restarted between two
beats), the Redis watch beats at once: workers give a gateway missing from a new Redis only CONFIRM_S.
A failed beat is an outage the watch logs once, not a line a second.
"""

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator

import redis
import redis.asyncio
from aiohttp import web

from kvrelay.gateway.redis_watch import REDIS_WATCH, RedisWatch
from kvrelay.gateway.state import DISPATCHER, REDIS
from kvrelay.gateway.tasks import cancel_and_wait
from kvrelay.shared.wire import redis_keys as keys

log = logging.getLogger("kvrelay.gateway")


class GatewayHeartbeat:
    def __init__(self, client: redis.asyncio.Redis, reply_addr: str, watch: RedisWatch):
        self._redis = client
        self._watch = watch
        self._key = keys.gateway_key(reply_addr)
        self._value = f"{socket.gethostname()}-{os.getpid()}"
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._beat()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvrelay-gateway-heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        try:
            await self._redis.delete(self._key)
        except redis.RedisError as exc:  # the key's TTL ends it anyway
            if not self._watch.health.absorb(exc):
                log.warning("could not delete the gateway's liveness key (%s)", exc)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(keys.GATEWAY_HEARTBEAT_S)
            await self._beat()

    async def publish(self) -> None:
        """One beat, raising what Redis says (the watch's ``on_back``)."""
        await self._redis.set(self._key, self._value, ex=keys.GATEWAY_TTL_S)

    async def _beat(self) -> None:
        try:
            await self.publish()
        except redis.RedisError as exc:  # Redis restarting: the next beat writes the key again
            if not self._watch.health.absorb(exc):
                log.warning("gateway heartbeat failed (%s)", exc)


async def heartbeat_ctx(app: web.Application) -> AsyncIterator[None]:
    watch = app[REDIS_WATCH]
    beat = GatewayHeartbeat(app[REDIS], app[DISPATCHER].address, watch)
    watch.on_back.append(beat.publish)
    await beat.start()
    yield
    watch.on_back.remove(beat.publish)  # the key deleted on the way out stays deleted
    await beat.close()
