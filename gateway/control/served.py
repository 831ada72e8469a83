"""What clients can be served by, by the names they use: the served view (``/v1/models``, ``/ready``) and
a client's model name resolved to the instance that serves it (``model_registry.py``), a registered model
no worker holds loaded on the way (``placement.py``), the request waiting for it.
"""

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from kvrelay.gateway.control.model_registry import MODEL_REGISTRY, is_direct
from kvrelay.gateway.control.placement import PLACEMENT, LoadError
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY, Capacity, capacity_of, stalled_out
from kvrelay.gateway.errors import APIError, bad_request, unavailable
from kvrelay.gateway.redis_watch import REDIS_WATCH
from kvrelay.gateway.state import CONFIG
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec, WorkerInfo


@dataclass
class Served:
    """What this gateway serves, by the names clients use: one reading of Redis that a request's resolution
    (``resolve_served``), ``/v1/models`` and ``/ready`` all decide from, so the list cannot disagree with
    what a request gets."""

    specs: dict[str, ModelSpec]  # registered names: a request loads one no worker holds
    models: dict[str, ModelInfo]  # every published instance, by instance key ("name@3", or a direct name)
    direct: dict[str, ModelInfo]  # published by a worker started with --model; a registered name wins
    workers: list[WorkerInfo]  # live ones
    routable: list[WorkerInfo]  # the live ones that step: new jobs go to them (stalled_workers.py)
    startup: set[str]  # what kvrelay serve started: /ready waits for its workers

    @property
    def known(self) -> set[str]:
        """Every name a request resolves; any other is a 404."""
        return set(self.specs) | set(self.direct)

    def instance(self, name: str) -> str:
        spec = self.specs.get(name)
        return spec.instance if spec else name

    def info(self, name: str) -> ModelInfo | None:
        return self.models.get(self.instance(name))

    def capacity(self, name: str) -> Capacity:
        return capacity_of(self.workers, self.instance(name))

    def loaded(self, name: str) -> bool:
        """Live workers hold it, both phases: a request for it is served without a load."""
        return name in self.known and self.capacity(name).servable

    def stalled(self, name: str) -> bool:
        """Every live worker of one of its phases is stalled (stalled_workers.py): a request for it gets 503
        until one steps again, registered or not (a load would find it loaded)."""
        return stalled_out(self.capacity(name), capacity_of(self.routable, self.instance(name)))

    def servable(self, name: str) -> bool:
        """A request for it is served: it is registered (its request loads it where no worker holds it) or
        its workers are up, and its workers of neither phase are all stalled. A direct model with no live
        worker gets 503, one only stalled workers hold 503, an unknown name 404."""
        return not self.stalled(name) and (name in self.specs or self.loaded(name))

    def listed(self) -> list[str]:
        """What ``/v1/models`` lists before a caller's key narrows it: every name a request is served for."""
        return sorted(name for name in self.known if self.servable(name))

    def lacks_startup(self) -> bool:
        """A model kvrelay serve started is not listed: served or not, this reading may be older than what another
        gateway process sharing the port (``--api-server-count``) answered /ready 200 from."""
        return not self.startup <= set(self.listed())

    def ready(self, name: str) -> bool:
        """``/ready``'s test of a model it waits for (``required``): servable, the very test ``listed`` makes,
        and routable workers hold both its phases. So a model /ready counts as served is in /v1/models from the
        same reading, whatever either test comes to say."""
        return self.servable(name) and capacity_of(self.routable, self.instance(name)).servable

    def required(self) -> dict[str, Capacity]:
        """The names that need live workers before this gateway is ready, and the routable workers they have
        (a stalled one takes no new job, so it serves no request now): those kvrelay serve started, the
        registered ones that are pinned or keep replicas, and those published directly while a live worker
        still holds them (one phase down, or only stalled, is not ready); a registered model loaded on demand
        does not (its first request loads it). A direct model whose workers are all gone is what a finished
        deployment left in Redis (its record outlives them by ``MODEL_TTL_S``, one an older kvrelay wrote
        without a TTL too: ``model_record_ttl.py``): it answers 503 until then, but never holds back the
        models that are served."""
        needed = [*(name for name in self.direct if name in self.startup or self._held(name)),
                  *(name for name, s in self.specs.items()
                    if s.pinned or s.min_replicas > 0 or name in self.startup)]
        return {name: capacity_of(self.routable, self.instance(name)) for name in needed}

    def _held(self, name: str) -> bool:
        held = self.capacity(name)
        return held.prefill > 0 or held.decode > 0


async def served(app: web.Application, fresh: bool = False) -> Served:
    registry = app[WORKER_REGISTRY]
    models = await registry.models(fresh)
    specs = await app[MODEL_REGISTRY].specs(fresh)
    workers = await registry.workers(fresh)
    direct = {name: m for name, m in models.items() if is_direct(m) and name not in specs}
    return Served(specs, models, direct, workers, registry.stalls.routable(workers), set(app[CONFIG].startup_models))


async def resolve_served(app: web.Application, name: str | None,
                         may_use: Callable[[str], bool]) -> tuple[str, ModelInfo]:
    """The client's model name and the ModelInfo of the instance that serves it (``model_registry.py``).
    A registered model nobody has published yet is loaded here, the request waiting for it."""
    view = await served(app)
    if not name:  # left out or "" (what some clients send, vLLM's reading): the only model
        # "the only model" means the only one the caller may use: others' models are not its business
        usable = [n for n in sorted(view.known) if may_use(n)]
        if len(usable) == 1:
            name = usable[0]
        else:
            raise bad_request("model is required: this server serves several models" if usable
                              else "no model is registered", "model")
    if name not in view.known:
        # the cached view may predate the model's registration (another gateway's admin call, a worker
        # registering its --config models): a miss is read again from Redis before it becomes a 404
        view = await served(app, fresh=True)
    if name not in view.known and not app[REDIS_WATCH].settling:
        # a miss right after a restart the periodic probe has not seen yet must not become a 404:
        # probe once now (only on this rare path)
        await app[REDIS_WATCH].check()
    if name not in view.known and app[REDIS_WATCH].settling:
        # Redis just restarted empty: workers re-publish their models within a heartbeat, so this is
        # "retry shortly", not "no such model"
        raise unavailable(f"model `{name}` is not registered yet (Redis restarted); retry later",
                          app[CONFIG].retry_after_s)
    if name not in view.known:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    if not may_use(name):
        raise APIError(403, f"Your API key may not use the model `{name}`.", param="model",
                       code="model_not_allowed")
    if name in view.specs:
        info = view.info(name)
        return name, info if info is not None else await load_model(app, name)
    return name, view.direct[name]


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
        await app[PLACEMENT].ensure_loaded(spec, config.model_load_timeout, request=True)
    except LoadError as exc:
        raise APIError(503, f"model `{name}` could not be loaded: {exc}", code="model_unavailable",
                       headers={"Retry-After": str(config.retry_after_s)}) from None
    info = await app[WORKER_REGISTRY].model(spec.instance, fresh=True)
    if info is None:  # unloaded again at once (evicted): rare, and retrying is the answer
        raise unavailable(f"model `{name}` was unloaded while loading; retry later", config.retry_after_s)
    return info


async def require_capacity(app: web.Application, model: ModelInfo, served: str | None = None) -> ModelInfo:
    """``model`` if routable workers serve both its phases; a registered model no worker holds any more
    (evicted, idle-unloaded, its worker restarted) is loaded again. One whose only workers for a phase are
    stalled (stalled_workers.py) answers 503 naming them: a load would find it loaded, and a job would wait."""
    registry = app[WORKER_REGISTRY]
    capacity = await registry.capacity(model.name)
    if not capacity.servable:
        # the cached view may predate the workers' registration (another gateway's /ready saw them):
        # a miss is read again from Redis before it becomes a 503
        capacity = await registry.capacity(model.name, fresh=True)
    if capacity.servable:
        return model
    if stalled := registry.stalled_out(await registry.workers(), model.name):
        raise APIError(503, f"{stalled}; retry later", code="worker_stalled",
                       headers={"Retry-After": str(app[CONFIG].retry_after_s)})
    if served is not None and served in await app[MODEL_REGISTRY].specs():
        return await load_model(app, served)
    missing = "prefill" if capacity.prefill == 0 else "decode"
    raise unavailable(f"no live {missing} worker for model {model.name!r}; retry later", app[CONFIG].retry_after_s)
