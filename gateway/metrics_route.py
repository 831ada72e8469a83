"""``GET /metrics``: the gateway's Prometheus registry, with the queue gauges renewed from Redis first."""

import logging

import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvrelay.gateway.state import METRICS, REDIS, REGISTRY

log = logging.getLogger("kvrelay.gateway")


async def scrape(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    try:
        models = sorted(await request.app[REGISTRY].models())
        await metrics.queues.refresh(request.app[REDIS], models)
    except redis.RedisError as exc:
        # The gateway's own counters are still worth a scrape; the queue gauges are left out, not shown stale.
        log.warning("queue metrics unavailable: %s", exc)
        metrics.queues.snapshot = {}
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
