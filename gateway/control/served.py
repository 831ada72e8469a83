"""What clients can be served by, by the names they use: the served view (``/v1/models``, ``/ready``) and
a client's model name resolved to the instance that serves it (``model_registry.py``), a registered model
no worker holds loaded on the way (``placement.py``), the request waiting for it.
"""

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from kvrelay.gateway.control.model_registry import MODEL_REGISTRY, is_direct
from kvrelay.gateway.control.placement import PLACEMENT, LoadError
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY, Capacity
from kvrelay.gateway.errors import APIError, bad_request, unavailable
from kvrelay.gateway.redis_watch import REDIS_WATCH
from kvrelay.gateway.state import CONFIG
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec


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
    registry, startup = app[WORKER_REGISTRY], set(app[CONFIG].startup_models)
    models = await registry.models()
    specs = await app[MODEL_REGISTRY].specs()
    loaded = {m.name: m.name for m in models.values() if is_direct(m) and m.name not in specs}
    loaded |= {name: s.instance for name, s in specs.items() if s.pinned or s.min_replicas > 0 or name in startup}
    capacity = {name: await registry.capacity(instance) for name, instance in loaded.items()}
    return Served(set(loaded) | set(specs), capacity, specs, models)


async def _served_view(app: web.Application, fresh: bool = False
                       ) -> tuple[dict[str, ModelInfo], dict[str, ModelSpec], dict[str, ModelInfo]]:
    models = await app[WORKER_REGISTRY].models(fresh)
    specs = await app[MODEL_REGISTRY].specs(fresh)
    return models, specs, {n: m for n, m in models.items() if is_direct(m)}


async def resolve_served(app: web.Application, name: str | None,
                         may_use: Callable[[str], bool]) -> tuple[str, ModelInfo]:
    """The client's model name and the ModelInfo of the instance that serves it (``model_registry.py``).
    A registered model nobody has published yet is loaded here, the request waiting for it."""
    models, specs, direct = await _served_view(app)
    if name is None:
        # "the only model" means the only one the caller may use: others' models are not its business
        usable = [n for n in sorted(set(specs) | set(direct)) if may_use(n)]
        if len(usable) == 1:
            name = usable[0]
        else:
            raise bad_request("model is required" if usable else "no model is registered", "model")
    if name is not None and name not in specs and name not in direct:
        # the cached view may predate the model's registration (another gateway's admin call, a worker
        # registering its --config models): a miss is read again from Redis before it becomes a 404
        models, specs, direct = await _served_view(app, fresh=True)
    if name not in specs and name not in direct and not app[REDIS_WATCH].settling:
        # a miss right after a restart the periodic probe has not seen yet must not become a 404:
        # probe once now (only on this rare path)
        await app[REDIS_WATCH].check()
    if name not in specs and name not in direct and app[REDIS_WATCH].settling:
        # Redis just restarted empty: workers re-publish their models within a heartbeat, so this is
        # "retry shortly", not "no such model"
        raise unavailable(f"model `{name}` is not registered yet (Redis restarted); retry later",
                          app[CONFIG].retry_after_s)
    if name not in specs and name not in direct:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    if not may_use(name):
        raise APIError(403, f"Your API key may not use the model `{name}`.", param="model",
                       code="model_not_allowed")
    if name in specs:
        info = models.get(specs[name].instance)
        return name, info if info is not None else await load_model(app, name)
    return name, direct[name]


async def resolve_model(app: web.Application, name: str | None, may_use: Callable[[str], bool]) -> ModelInfo:
    return (await resolve_served(app, name, may_use))[1]


async def load_model(app: web.Application, name: str) -> ModelInfo:
    """Lazy load: wait (bounded by --model-load-timeout) until some workers serve the registered model's
    active version. 503 + Retry-After naming the reason when no worker can take it or the load fails."""
    config = app[CONFIG]
    spec = await app[MODEL_REGISTRY].spec(name)  # from Redis, not the cache: a swap may just have moved it
    if spec is None:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    try:
        await app[PLACEMENT].ensure_loaded(spec, config.model_load_timeout)
    except LoadError as exc:
        raise APIError(503, f"model `{name}` could not be loaded: {exc}", code="model_unavailable",
                       headers={"Retry-After": str(config.retry_after_s)}) from None
    info = await app[WORKER_REGISTRY].model(spec.instance, fresh=True)
    if info is None:  # unloaded again at once (evicted): rare, and retrying is the answer
        raise unavailable(f"model `{name}` was unloaded while loading; retry later", config.retry_after_s)
    return info


async def require_capacity(app: web.Application, model: ModelInfo, served: str | None = None) -> ModelInfo:
    """``model`` if live workers serve both its phases; a registered model no worker holds any more
    (evicted, idle-unloaded, its worker restarted) is loaded again."""
    capacity = await app[WORKER_REGISTRY].capacity(model.name)
    if not capacity.servable:
        # the cached view may predate the workers' registration (another gateway's /ready saw them):
        # a miss is read again from Redis before it becomes a 503
        capacity = await app[WORKER_REGISTRY].capacity(model.name, fresh=True)
    if capacity.servable:
        return model
    if served is not None and served in await app[MODEL_REGISTRY].specs():
        return await load_model(app, served)
    missing = "prefill" if capacity.prefill == 0 else "decode"
    raise unavailable(f"no live {missing} worker for model {model.name!r}; retry later", app[CONFIG].retry_after_s)
