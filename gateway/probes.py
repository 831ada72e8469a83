"""What orchestrators and scrapers ask, open to them without a tenant key and answered while draining:
``GET /health`` (the process answers and reaches its store), ``GET /ready`` (can requests be served)
and ``GET /metrics`` (the gateway's Prometheus registry, with the queue gauges and the workers' engine
series renewed from Redis first). Beside them, each gateway loads the tokenizers /ready waits for on its own
(``warm_tokenizers_ctx``)."""

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvrelay.gateway.api.tokenizer_pool import TOKENIZERS
from kvrelay.gateway.control.served import Served, served
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY
from kvrelay.gateway.drain import DRAIN
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.redis_watch import REDIS_WATCH, redis_failed
from kvrelay.gateway.state import CONFIG, METRICS, REDIS
from kvrelay.gateway.tasks import cancel_and_wait

log = logging.getLogger("kvrelay.gateway")
WARM_TOKENIZERS_EVERY_S = 1.0


async def health(request: web.Request) -> web.Response:
    """200 while the process answers and its store (Redis: tenants, keys, limits, the job queues) was
    reachable at the Redis watch's last probe; 503 in OpenAI's error shape while it is not, since no
    request can be served then. Read from the watch's state, never a round trip per probe: a probe
    storm costs Redis nothing. Until the first probe answered it is 503 too. A Redis blip fails it
    for as long as the blip, so a liveness probe on it wants a failure threshold longer than the
    outages worth riding out (restarting a gateway brings no store back, and ends its streams)."""
    store = request.app[REDIS_WATCH].health
    if not store.reachable:
        down = f" for {store.down_for():.0f} s" if store.down_for() else ""
        return APIError(503, f"the control-plane store (Redis) is unreachable{down}", code="store_unavailable",
                        headers={"Retry-After": str(request.app[CONFIG].retry_after_s)}).response()
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers, every model this deployment was started with (``startup_models``,
    ``lazy_models``) is known, and every model that needs live workers (``Served.required``) has a live
    prefill-capable and a live decode-capable worker that steps (a stalled one takes no new job:
    stalled_workers.py): a request sent the moment this says 200 is served. Before any worker registers,
    a deployment started with a model is not ready; nor while the tokenizers of a model with live workers
    still load. The body says which part is missing: the workers counted are the routable ones, and
    ``stalled`` names the models whose only workers of a phase are stalled, and them. Each model is judged by
    ``Served.ready``, which holds ``/v1/models``' own test: what this counts as served, that lists."""
    retry = {"Retry-After": str(request.app[CONFIG].retry_after_s)}
    config = request.app[CONFIG]
    if request.app[DRAIN].draining:  # shutting down: take this gateway out of every load balancer now
        return web.json_response({"status": "draining"}, status=503, headers=retry)
    try:
        await request.app[REDIS].ping()
        view = await served(request.app)
    except redis.RedisError as exc:
        if not redis_failed(request.app, exc):
            log.warning("not ready: redis answered %s", exc)
        return web.json_response({"status": "unavailable", "redis": False, "models": {}}, status=503,
                                 headers=retry)
    missing = {name: {"prefill_workers": 0, "decode_workers": 0}
               for name in [*config.startup_models, *config.lazy_models] if name not in view.known}
    required = view.required()
    # which gateway process answered: several share one port (--api-server-count), each with tokenizers of its
    # own, and kvrelay serve says ready only once each of them has said 200
    body = {"status": "ready", "redis": True, "gateway_pid": os.getpid(),
            "models": {**{name: {"prefill_workers": c.prefill, "decode_workers": c.decode}
                          for name, c in required.items()}, **missing}}
    registry = request.app[WORKER_REGISTRY]
    stalled = {name: why for name in required if (why := registry.stalled_out(view.workers, view.instance(name)))}
    if stalled:
        body["stalled"] = stalled
    if not missing and all(view.ready(name) for name in required):
        # The first request must not pay the tokenizer load (seconds for a large vocabulary): each model
        # with live workers has its tokenizers loaded before this gateway says ready.
        loading = sorted(name for name in required if not _tokenizer_ready(request.app, view, name))
        if not loading:
            return web.json_response(body)
        body["tokenizers_loading"] = loading
    body["status"] = "unavailable"
    return web.json_response(body, status=503, headers=retry)


def _tokenizer_ready(app: web.Application, view: Served, name: str) -> bool:
    info = view.info(name)
    return info is None or app[TOKENIZERS].prefetch(info)


async def warm_tokenizers_ctx(app: web.Application) -> AsyncIterator[None]:
    """Each gateway starts loading the tokenizers of the models with live workers as they come up, whether its
    /ready is asked or not: gateways sharing a port (--api-server-count), or one restarted behind a load
    balancer, may take requests before anyone asked theirs, and those would wait for the load."""
    task = asyncio.create_task(_warm_tokenizers(app))
    yield
    await cancel_and_wait(task)


async def _warm_tokenizers(app: web.Application) -> None:
    while True:
        try:
            view = await served(app)
            for name in view.required():
                if view.ready(name):
                    _tokenizer_ready(app, view, name)
        except redis.RedisError:
            pass  # /ready and the requests say so; this only starts loads early
        await asyncio.sleep(WARM_TOKENIZERS_EVERY_S)


async def scrape(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    try:
        registry = request.app[WORKER_REGISTRY]
        models = sorted(await registry.models())
        await metrics.queues.refresh(request.app[REDIS], models)
        view = await served(request.app)
        metrics.vllm.know(view.listed())
        metrics.engines.workers = metrics.worker_steps.workers = await registry.workers()
        metrics.worker_steps.stalled = set(registry.stalls.ages)
    except redis.RedisError as exc:
        # The gateway's own counters are still worth a scrape; the queue gauges and the engines' series
        # are left out, not shown stale.
        if not redis_failed(request.app, exc):
            log.warning("queue metrics unavailable: %s", exc)
        metrics.queues.snapshot = {}
        metrics.engines.workers = metrics.worker_steps.workers = []
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
