"""Typed keys for what every room of the gateway shares: its config, Redis, metrics, the token-event
dispatcher and the detached background tasks. Each room keeps its own keys beside the class they hold
(``tenancy.tenants.TENANTS``, ``control.placement.PLACEMENT``, ...)."""

import asyncio

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.dispatcher import Dispatcher
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.shared.config.gateway import GatewayConfig

CONFIG = web.AppKey("config", GatewayConfig)
REDIS = web.AppKey("redis", redis.asyncio.Redis)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
METRICS = web.AppKey("metrics", GatewayMetrics)
# Fire-and-forget work (abort publishes from finishing handlers) kept referenced until done.
BACKGROUND = web.AppKey("background", set[asyncio.Task])


def spawn(app: web.Application, coro) -> asyncio.Task:
    """Run ``coro`` detached from the handler, so a cancelled (disconnected) handler still runs it."""
    tasks = app[BACKGROUND]
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
