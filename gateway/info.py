"""``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (can requests be served) and
``GET /openapi.json`` (the API description, from openapi.yaml beside this file)."""

import functools
import logging
from pathlib import Path

import redis
import yaml
from aiohttp import web

from gateway.auth import TENANT
from gateway.drain import DRAIN
from gateway.errors import APIError
from gateway.state import CONFIG, REDIS, REGISTRY

log = logging.getLogger("kvrelay.gateway")


async def list_models(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    try:
        models = await registry.models()
    except redis.RedisError as exc:
        raise APIError(503, f"model registry unavailable: {exc}", code="registry_unavailable") from None
    tenant = request[TENANT]
    data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "kvrelay", "root": m.name,
             "parent": None, "max_model_len": m.max_model_len} for m in models.values() if tenant.may_use(m.name)]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """Liveness only: the process answers. Dependencies belong to /ready, or a Redis blip would restart
    every gateway at once."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers and every registered model has a live prefill-capable and a live
    decode-capable worker. The body says which part is missing."""
    registry = request.app[REGISTRY]
    retry = {"Retry-After": str(request.app[CONFIG].retry_after_s)}
    if request.app[DRAIN].draining:  # shutting down: take this gateway out of every load balancer now
        return web.json_response({"status": "draining"}, status=503, headers=retry)
    try:
        await request.app[REDIS].ping()
        models = await registry.models()
        capacity = {name: await registry.capacity(name) for name in models}
    except redis.RedisError as exc:
        log.warning("not ready: redis unreachable: %s", exc)
        return web.json_response({"status": "unavailable", "redis": False, "models": {}}, status=503,
                                 headers=retry)
    body = {"status": "ready", "redis": True,
            "models": {name: {"prefill_workers": c.prefill, "decode_workers": c.decode}
                       for name, c in capacity.items()}}
    if all(c.servable for c in capacity.values()):
        return web.json_response(body)
    body["status"] = "unavailable"
    return web.json_response(body, status=503, headers=retry)


@functools.cache
def _openapi() -> dict:
    return yaml.safe_load((Path(__file__).parent / "openapi.yaml").read_text())


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(_openapi())
