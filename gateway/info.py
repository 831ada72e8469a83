"""``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (can requests be served) and
``GET /openapi.json`` (the API description, from openapi.yaml beside this file)."""

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml
from aiohttp import web

from kvrelay.gateway.auth import TENANT
from kvrelay.gateway.drain import DRAIN
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.model_registry import is_direct
from kvrelay.gateway.registry import Capacity
from kvrelay.gateway.state import CONFIG, MODEL_REGISTRY, REDIS, REGISTRY, TOKENIZERS
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec

log = logging.getLogger("kvrelay.gateway")


@dataclass
class Served:
    """What this gateway can serve now, by the names clients use."""

    known: set[str]  # registered or published directly by a worker
    capacity: dict[str, Capacity]  # the known names that need loaded workers, and the workers they have
    specs: dict[str, ModelSpec]
    models: dict[str, ModelInfo]

    def servable(self, name: str) -> bool:
        """A request for it succeeds now: its workers are up, or it is registered and its request loads it."""
        return name in self.known and (name not in self.capacity or self.capacity[name].servable)


async def served(app: web.Application) -> Served:
    """Which names need live workers: those published directly, the registered ones that are pinned or keep
    replicas, and those kvrelay serve started; a registered model loaded on demand does not (its first
    request loads it), nor a repository instance that is no longer the active version."""
    registry, startup = app[REGISTRY], set(app[CONFIG].startup_models)
    models = await registry.models()
    specs = await app[MODEL_REGISTRY].specs()
    loaded = {m.name: m.name for m in models.values() if is_direct(m) and m.name not in specs}
    loaded |= {name: s.instance for name, s in specs.items() if s.pinned or s.min_replicas > 0 or name in startup}
    capacity = {name: await registry.capacity(instance) for name, instance in loaded.items()}
    return Served(set(loaded) | set(specs), capacity, specs, models)


async def list_models(request: web.Request) -> web.Response:
    """The models a request can be served by now (loaded, or registered and loaded by their first
    request), by the name clients use; never an instance key."""
    try:
        view = await served(request.app)
    except redis.RedisError as exc:
        raise APIError(503, f"model registry unavailable: {exc}", code="registry_unavailable") from None
    tenant = request[TENANT]
    data = []
    for name in sorted(n for n in view.known if view.servable(n) and tenant.may_use(n)):
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "kvrelay", "root": name, "parent": None}
        spec = view.specs.get(name)
        info = view.models.get(spec.instance if spec else name)
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
    """Ready when Redis answers, every model this deployment was started with (``startup_models``,
    ``lazy_models``) is known, and every model that needs live workers (``served``) has a live
    prefill-capable and a live decode-capable worker: a request sent the moment this says 200 is
    served. Before any worker registers, a deployment started with a model is not ready; nor while the
    tokenizers of a model with live workers still load. The body says which part is missing."""
    retry = {"Retry-After": str(request.app[CONFIG].retry_after_s)}
    config = request.app[CONFIG]
    if request.app[DRAIN].draining:  # shutting down: take this gateway out of every load balancer now
        return web.json_response({"status": "draining"}, status=503, headers=retry)
    try:
        await request.app[REDIS].ping()
        view = await served(request.app)
    except redis.RedisError as exc:
        log.warning("not ready: redis unreachable: %s", exc)
        return web.json_response({"status": "unavailable", "redis": False, "models": {}}, status=503,
                                 headers=retry)
    missing = {name: {"prefill_workers": 0, "decode_workers": 0}
               for name in [*config.startup_models, *config.lazy_models] if name not in view.known}
    body = {"status": "ready", "redis": True,
            "models": {**{name: {"prefill_workers": c.prefill, "decode_workers": c.decode}
                          for name, c in view.capacity.items()}, **missing}}
    if not missing and all(c.servable for c in view.capacity.values()):
        # The first request must not pay the tokenizer load (seconds for a large vocabulary): each model
        # with live workers has its tokenizers loaded before this gateway says ready.
        loading = sorted(name for name in view.capacity if not _tokenizer_ready(request.app, view, name))
        if not loading:
            return web.json_response(body)
        body["tokenizers_loading"] = loading
    body["status"] = "unavailable"
    return web.json_response(body, status=503, headers=retry)


def _tokenizer_ready(app: web.Application, view: Served, name: str) -> bool:
    spec = view.specs.get(name)
    info = view.models.get(spec.instance if spec else name)
    return info is None or app[TOKENIZERS].prefetch(info)


@functools.cache
def _openapi() -> dict:
    return yaml.safe_load((Path(__file__).parent / "openapi.yaml").read_text())


async def openapi(request: web.Request) -> web.Response:
    """The public API; the admin paths are described only to the admin (``/admin/openapi.json``)."""
    doc = _openapi()
    return web.json_response({**doc, "paths": {p: ops for p, ops in doc["paths"].items() if not p.startswith("/admin")}})


async def admin_openapi(request: web.Request) -> web.Response:
    return web.json_response(_openapi())
