"""The gateway application: ``create_app(config)`` builds it, ``run_gateway(config)`` serves it.

Resources live in cleanup contexts, started in order and closed in reverse: Redis (and the task that
watches it for restarts), then the ZMQ reply socket and its dispatcher task, then the liveness key
workers watch for that socket's address (``heartbeat.py``), then the set of detached
background tasks, then the model reconciler (``reconciler.py``). SIGTERM drains the gateway before it
exits (``drain.py``).
"""

import asyncio
import logging
from collections.abc import AsyncIterator

import redis
from aiohttp import web

from kvrelay.gateway.auth import auth_middleware
from kvrelay.gateway.connection_guard import CONNECTION_GUARD, ConnectionGuard
from kvrelay.gateway.dispatcher import Dispatcher
from kvrelay.gateway.drain import DRAIN, Drain, make_drain_middleware, serve
from kvrelay.gateway.errors import add_request_id, error_middleware
from kvrelay.gateway.heartbeat import heartbeat_ctx
from kvrelay.gateway.limits import RateLimiter
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.model_registry import ModelRegistry
from kvrelay.gateway.placement import Placement
from kvrelay.gateway.reconciler import reconciler_ctx
from kvrelay.gateway.redis_watch import REDIS_WATCH, RedisWatch
from kvrelay.gateway.registry import Registry
from kvrelay.gateway.response_cache import ResponseCache
from kvrelay.gateway.routes import ROUTES
from kvrelay.gateway.routing import PrefixIndex
from kvrelay.gateway.state import (
    BACKGROUND,
    CONFIG,
    DISPATCHER,
    LIMITER,
    METRICS,
    MODEL_REGISTRY,
    MODEL_REPO,
    PLACEMENT,
    PREFIX_INDEX,
    REDIS,
    REGISTRY,
    RESPONSE_CACHE,
    TENANTS,
    TOKENIZERS,
    USAGE,
)
from kvrelay.gateway.tenants import TenantStore
from kvrelay.gateway.tokenizers import TokenizerPool
from kvrelay.gateway.usage import UsageLedger
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire.redis_conn import async_client
from kvrelay.shared.wire.tenant_label import metrics_salt_async, tenant_labeler
from kvrelay.shared.wire.zmq_auth import keys_from_secret

log = logging.getLogger("kvrelay.gateway")

# How long shutdown waits for in-flight abort publishes before dropping them.
_BACKGROUND_DRAIN_S = 2.0
TENANT_PENDING = "pending"  # the tenant label until the metrics salt is known


async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
    client = async_client(app[CONFIG].redis_url)
    app[REDIS] = client
    config = app[CONFIG]
    app[TENANTS] = TenantStore(client)
    salt_task = None
    if not config.metrics_tenant_labels:
        app[METRICS].tenant = lambda tenant: TENANT_PENDING
        salt_task = asyncio.create_task(_tenant_salt(app[METRICS], client))
    app[LIMITER] = RateLimiter(client)
    app[USAGE] = UsageLedger(client, config.usage_retention_s)
    app[RESPONSE_CACHE] = ResponseCache(client, config.response_cache_ttl, config.response_cache_max_bytes)
    registry = app[REGISTRY] = Registry(client, config.registry_cache_s)
    app[MODEL_REGISTRY] = ModelRegistry(client, config.registry_cache_s)
    app[PLACEMENT] = Placement(client, registry)
    watch = app[REDIS_WATCH] = RedisWatch(client, app[CONFIG].redis_watch_s, app[CONFIG].redis_outage_s)
    watch.start()
    yield
    if salt_task is not None:
        salt_task.cancel()
    await watch.close()
    await client.aclose()


async def _tenant_salt(metrics: GatewayMetrics, client) -> None:
    """Tenants are shown hashed under the deployment's salt (shared/wire/tenant_label.py); while Redis
    cannot give it (the gateway starts without Redis, as it serves without it) they are shown as a
    placeholder, never by name."""
    while True:
        try:
            metrics.tenant = tenant_labeler(await metrics_salt_async(client))
            return
        except redis.RedisError as exc:
            log.warning("no metrics salt from Redis yet (%s); tenants show as %r", exc, TENANT_PENDING)
            await asyncio.sleep(1.0)


async def dispatcher_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    dispatcher = Dispatcher(config.zmq_host, config.zmq_port, config.reply_host,
                            curve=keys_from_secret(config.zmq_secret, config.insecure_zmq))
    await dispatcher.start()
    log.info("token events arrive at %s", dispatcher.address)
    app[DISPATCHER] = dispatcher
    yield
    await dispatcher.close()


async def background_ctx(app: web.Application) -> AsyncIterator[None]:
    app[BACKGROUND] = set()
    yield
    tasks = set(app[BACKGROUND])
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=_BACKGROUND_DRAIN_S)
        for task in pending:
            task.cancel()


async def close_tokenizers(app: web.Application) -> None:
    app[TOKENIZERS].close()


def create_app(config: GatewayConfig) -> web.Application:
    # client_max_size makes aiohttp raise 413 while reading an oversized body; the middleware shapes it.
    # The drain check sits inside error_middleware so its 503 gets the same OpenAI shape as every error.
    app = web.Application(client_max_size=config.max_body_size,
                          middlewares=[error_middleware, make_drain_middleware(config.retry_after_s)])
    app[CONFIG] = config
    metrics = app[METRICS] = GatewayMetrics(config.queue_metrics_cache_s)
    # Outermost, metrics count what the client got (error bodies included); innermost, auth raises
    # into error_middleware so 401/403 come out in OpenAI's shape.
    app.middlewares.insert(0, metrics.middleware)
    # outermost of all: a connection is busy from its handler's start until its response is written
    guard = app[CONNECTION_GUARD] = ConnectionGuard(config.timeout_header_read, config.limit_idle_connections,
                                                    lambda reason: metrics.connections_closed.labels(reason).inc())
    app.middlewares.insert(0, guard.middleware)
    app.middlewares.append(auth_middleware)
    app[DRAIN] = Drain()
    app[TOKENIZERS] = TokenizerPool()
    app.on_cleanup.append(close_tokenizers)  # runs after cleanup_ctx: no request tokenizes any more
    app[PREFIX_INDEX] = PrefixIndex()
    if config.model_repo:
        app[MODEL_REPO] = ModelRepository(config.model_repo)
    # Cleanup runs in reverse: the reconciler stops first, then background tasks (abort publishes, model
    # loads) drain, while Redis is still open.
    app.cleanup_ctx.extend([redis_ctx, dispatcher_ctx, heartbeat_ctx, background_ctx, reconciler_ctx])
    app.on_response_prepare.append(add_request_id)
    app.add_routes(ROUTES)
    return app


def run_gateway(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain (what ``kvrelay gateway`` calls)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(create_app(config), config.host, config.port, config.drain_timeout, config.reuse_port))
