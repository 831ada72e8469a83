"""The control room on the app: its cleanup context puts the view of what workers published, the model
registry, placement, the queue lengths requests read before queueing, the router (its policy built once
from the config) and, with ``--model-repo``, the model repository under their keys; the registry is
published again when Redis comes back without it.
The reconciler has a context of its own (``reconciler.py``): it must stop before the background tasks
it spawns are drained."""

from collections.abc import AsyncIterator

from aiohttp import web

from kvrelay.gateway.control.model_admin import MODEL_REPO
from kvrelay.gateway.control.model_registry import MODEL_REGISTRY, ModelRegistry
from kvrelay.gateway.control.placement import PLACEMENT, Placement
from kvrelay.gateway.control.routing import ROUTER, Policy, Router
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY, WorkerRegistry
from kvrelay.gateway.queue_lengths import QUEUE_LENGTHS, QueueLengths
from kvrelay.gateway.redis_watch import REDIS_WATCH
from kvrelay.gateway.state import CONFIG, REDIS
from kvrelay.shared.repo.model_repo import ModelRepository


async def control_ctx(app: web.Application) -> AsyncIterator[None]:
    client, config = app[REDIS], app[CONFIG]
    registry = app[WORKER_REGISTRY] = WorkerRegistry(client, config.registry_cache_s,
                                                             config.stalled_step_timeout_s)
    models = app[MODEL_REGISTRY] = ModelRegistry(client, config.registry_cache_s)
    watch = app[REDIS_WATCH]

    async def republish() -> None:  # Redis back as another server: the registry entries it lost
        await models.republish(watch.run_id)

    watch.on_back.append(republish)
    app[PLACEMENT] = Placement(client, registry)
    app[QUEUE_LENGTHS] = QueueLengths(client)
    app[ROUTER] = Router(Policy(config.prefix_affinity, config.affinity_slack, config.affinity_prefix_tokens))
    if config.model_repo:
        app[MODEL_REPO] = ModelRepository(config.model_repo)
    yield
    watch.on_back.remove(republish)
