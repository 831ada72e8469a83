"""Typed keys for what the app's cleanup contexts create and handlers use."""

import asyncio

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.dispatcher import Dispatcher
from kvrelay.gateway.limits import RateLimiter
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.model_registry import ModelRegistry
from kvrelay.gateway.placement import Placement
from kvrelay.gateway.registry import Registry
from kvrelay.gateway.response_cache import ResponseCache
from kvrelay.gateway.routing import PrefixIndex
from kvrelay.gateway.tenants import TenantStore
from kvrelay.gateway.tokenizers import TokenizerPool
from kvrelay.gateway.usage import UsageLedger
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.repo.model_repo import ModelRepository

CONFIG = web.AppKey("config", GatewayConfig)
REDIS = web.AppKey("redis", redis.asyncio.Redis)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
REGISTRY = web.AppKey("registry", Registry)
TOKENIZERS = web.AppKey("tokenizers", TokenizerPool)
TENANTS = web.AppKey("tenants", TenantStore)
LIMITER = web.AppKey("limiter", RateLimiter)
USAGE = web.AppKey("usage", UsageLedger)
RESPONSE_CACHE = web.AppKey("response_cache", ResponseCache)
METRICS = web.AppKey("metrics", GatewayMetrics)
MODEL_REGISTRY = web.AppKey("model_registry", ModelRegistry)
PLACEMENT = web.AppKey("placement", Placement)
PREFIX_INDEX = web.AppKey("prefix_index", PrefixIndex)
# Only set with --model-repo: the admin API checks registrations against it (app.get(MODEL_REPO)).
MODEL_REPO = web.AppKey("model_repo", ModelRepository)
# Fire-and-forget work (abort publishes from finishing handlers) kept referenced until done.
BACKGROUND = web.AppKey("background", set[asyncio.Task])


def spawn(app: web.Application, coro) -> asyncio.Task:
    """Run ``coro`` detached from the handler, so a cancelled (disconnected) handler still runs it."""
    tasks = app[BACKGROUND]
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
