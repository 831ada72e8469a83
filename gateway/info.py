"""``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (can requests be served) and
``GET /openapi.json`` (the API description, from openapi.yaml beside this file)."""

import functools
import logging
from pathlib import Path

import redis
import yaml
from aiohttp import web
from kvrelay.gateway.auth import TENANT
from kvrelay.gateway.drain import DRAIN
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.model_registry import is_direct
from kvrelay.gateway.state import CONFIG, MODEL_REGISTRY, REDIS, REGISTRY

log = logging.getLogger("kvrelay.gateway")


async def list_models(request: web.Request) -> web.Response:
    """Registered models (loaded or not: a request loads them) and those workers publish directly, by
    the name clients use; never an instance key."""
    registry = request.app[REGISTRY]
    try:
        models = await registry.models()
        specs = await request.app[MODEL_REGISTRY].specs()
    except redis.RedisError as exc:
        raise APIError(503, f"model registry unavailable: {exc}", code="registry_unavailable") from None
    tenant = request[TENANT]
    data = []
    for name in sorted(set(specs) | {m.name for m in models.values() if is_direct(m)}):
        if not tenant.may_use(name):
            continue
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "kvrelay", "root": name, "parent": None}
        spec = specs.get(name)
        info = models.get(spec.instance if spec else name)
        max_len = info.max_model_len if info else spec.max_model_len if spec else 0
        if max_len:
            entry["max_model_len"] = max_len
        if spec is not None and spec.version:
            entry["version"] = spec.version
        data.append(entry)
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """Liveness only: the process answers. Dependencies belong to /ready, or a Redis blip would restart
    every gateway at once."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers and every model that should be up has a live prefill-capable and a live
    decode-capable worker: the models workers publish directly, and registered ones that are pinned or
    keep replicas. A registered model loaded on demand is not required (its first request loads it), nor
    is a repository instance that is no longer the active version. The body says which part is missing."""
    registry = request.app[REGISTRY]
    retry = {"Retry-After": str(request.app[CONFIG].retry_after_s)}
    if request.app[DRAIN].draining:  # shutting down: take this gateway out of every load balancer now
        return web.json_response({"status": "draining"}, status=503, headers=retry)
    try:
        await request.app[REDIS].ping()
        models = await registry.models()
        specs = await request.app[MODEL_REGISTRY].specs()
        required = {m.name: m.name for m in models.values() if is_direct(m) and m.name not in specs}
        required |= {name: s.instance for name, s in specs.items() if s.pinned or s.min_replicas > 0}
        capacity = {name: await registry.capacity(instance) for name, instance in required.items()}
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
    """The public API; the admin paths are described only to the admin (``/admin/openapi.json``)."""
    doc = _openapi()
    return web.json_response({**doc, "paths": {p: ops for p, ops in doc["paths"].items() if not p.startswith("/admin")}})


async def admin_openapi(request: web.Request) -> web.Response:
    return web.json_response(_openapi())
