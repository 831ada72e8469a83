"""The gateway application: ``create_app(config)`` builds it, ``run_gateway(config)`` serves it.

The gateway has three rooms, each wired in by its cleanup context: ``api/`` (the OpenAI API: routes,
schemas, prompts, generation, SSE), ``tenancy/`` (API keys, tenants, limits, usage) and ``control/``
(the model control plane: what workers publish, the model registry, placement, routing, the
reconciler, the model admin API). What they share lives beside this file: the app's keys
(``state.py``), errors, request bodies, drain, metrics, the Redis watch and the token-event dispatcher.

Resources live in cleanup contexts, started in order and closed in reverse: Redis (and the task that
watches it for restarts), the rooms' stores on it, then the ZMQ reply socket and its dispatcher task,
then the liveness key workers watch for that socket's address (``heartbeat.py``), then the set of
detached background tasks, then the model reconciler (``control/reconciler.py``). SIGTERM drains the
gateway before it exits (``drain.py``).
"""

import asyncio
import gc
import logging
from collections.abc import AsyncIterator

import redis
from aiohttp import web

from kvrelay.gateway.api.context import api_ctx
from kvrelay.gateway.api.tokenizer_pool import TOKENIZERS, TokenizerPool
from kvrelay.gateway.connection_guard import CONNECTION_GUARD, ConnectionGuard
from kvrelay.gateway.control.context import control_ctx
from kvrelay.gateway.control.reconciler import reconciler_ctx
from kvrelay.gateway.dispatcher import Dispatcher
from kvrelay.gateway.drain import DRAIN, Drain, make_drain_middleware, serve
from kvrelay.gateway.errors import add_request_id, error_middleware
from kvrelay.gateway.heartbeat import heartbeat_ctx
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.probes import warm_tokenizers_ctx
from kvrelay.gateway.redis_watch import REDIS_WATCH, RedisWatch
from kvrelay.gateway.routes import ROUTES
from kvrelay.gateway.state import BACKGROUND, CONFIG, DISPATCHER, METRICS, REDIS
from kvrelay.gateway.tenancy.auth import auth_middleware
from kvrelay.gateway.tenancy.context import tenancy_ctx
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.wire import legacy_keys
from kvrelay.shared.wire.redis_cluster import is_cluster_url
from kvrelay.shared.wire.redis_conn import async_client
from kvrelay.shared.wire.redis_keys import METRICS_SALT
from kvrelay.shared.wire.tenant_label import metrics_salt_async, tenant_labeler
from kvrelay.shared.wire.zmq_auth import keys_from_secret

log = logging.getLogger("kvrelay.gateway")

# How long shutdown waits for in-flight abort publishes before dropping them.
_BACKGROUND_DRAIN_S = 2.0
TENANT_PENDING = "pending"  # the tenant label until the metrics salt is known


async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    client = app[REDIS] = async_client(config.redis_url)
    watch = app[REDIS_WATCH] = RedisWatch(client, config.redis_watch_s, config.redis_outage_s)
    salt_task = None
    if not config.metrics_tenant_labels:
        app[METRICS].tenant = lambda tenant: TENANT_PENDING
        salt_task = asyncio.create_task(_tenant_salt(app[METRICS], client, watch))
    # a Redis Cluster never held the names from before the hash tags
    migrate_task = None if is_cluster_url(config.redis_url) else asyncio.create_task(_migrate_keys(client, watch))
    watch.start()
    yield
    if salt_task is not None:
        salt_task.cancel()
    if migrate_task is not None:
        migrate_task.cancel()
    await watch.close()
    await client.aclose()


async def _tenant_salt(metrics: GatewayMetrics, client, watch: RedisWatch) -> None:
    """Tenants are shown hashed under the deployment's salt (shared/wire/tenant_label.py); while Redis
    cannot give it (the gateway starts without Redis, as it serves without it) they are shown as a
    placeholder, never by name. A Redis that lost it gets ours back (SET NX), so processes started
    after the loss hash tenants as the running ones do."""
    while True:
        try:
            salt = await metrics_salt_async(client)
            break
        except redis.RedisError as exc:
            if not watch.health.absorb(exc):
                log.warning("no metrics salt from Redis yet (%s); tenants show as %r", exc, TENANT_PENDING)
            await asyncio.sleep(1.0)
    metrics.tenant = tenant_labeler(salt)

    async def publish_salt() -> None:
        await client.set(METRICS_SALT, salt, nx=True)

    watch.on_back.append(publish_salt)


async def _migrate_keys(client, watch: RedisWatch) -> None:
    """Registry, tenants and API keys that an earlier version wrote under untagged names move to
    today's (shared/wire/legacy_keys.py), once Redis answers."""
    while True:
        try:
            moved = await legacy_keys.migrate(client)
            break
        except redis.RedisError as exc:
            if not watch.health.absorb(exc):
                log.warning("cannot move keys from their earlier names yet: %s", exc)
            await asyncio.sleep(1.0)
    if moved:
        log.info("moved %d Redis key(s) from their names before hash tags (registry, tenants, API keys)", moved)


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
    # Cleanup runs in reverse: the reconciler stops first, then background tasks (abort publishes, model
    # loads) drain, while Redis is still open.
    app.cleanup_ctx.extend([redis_ctx, tenancy_ctx, control_ctx, api_ctx, dispatcher_ctx, heartbeat_ctx,
                            background_ctx, warm_tokenizers_ctx, reconciler_ctx])
    app.on_response_prepare.append(add_request_id)
    app.add_routes(ROUTES)
    return app


async def freeze_long_lived(_app: web.Application) -> None:
    """Every streamed token allocates a few short-lived objects, so a busy gateway runs a full collection every
    few seconds, and one walks every object its imports made, during which no stream moves. As the workers do (shared/worker/
    gc_freeze.py), what exists once the app has started goes to the permanent generation. Only in a gateway
    process of its own: a frozen object that later dies in a reference cycle is never collected."""
    gc.collect()
    gc.freeze()


def run_gateway(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain (what ``kvrelay gateway`` calls)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    app.on_startup.append(freeze_long_lived)  # after every cleanup context has started
    asyncio.run(serve(app, config.host, config.port, config.drain_timeout, config.reuse_port))
