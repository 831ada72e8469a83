"""A queued request whose model left its workers waits for the model to load again, not for its deadline.

A request is queued for an instance the gateway saw loaded, but the workers may drop it before they read
the job: an eviction for another model's load, a keep-alive expiry, another gateway's unload, all
decided on views a fraction of a second newer than ours. Nobody reads that instance's stream then, and
without this the request would wait out its whole deadline for a 504. So while a request's jobs sit in
Redis unheard, ``ReloadWatch.check`` looks (fresh from Redis, at most every ``CHECK_EVERY_S``) whether
live workers still hold the instance, loaded, loading or draining, for both halves of a request
(prefill and decode; a unified worker is both). When they do not and the client's name still resolves
to it, it loads it again through ``Placement.ensure_loaded`` (one load per instance, shared with every
other waiting request and gateway; only the missing half is placed), and the request waits for that
load and then for its answer: from the reload on it may run up to ``--model-load-timeout`` past its own
deadline (``hold_until``), where the workers' backstop for its jobs lies (``Generation._submit``). A
load that fails ends the request with the workers' reason (503 ``model_unavailable``), as a first
request's lazy load does.
"""

import asyncio
import logging
import time

from aiohttp import web

from kvrelay.gateway.control.model_registry import MODEL_REGISTRY
from kvrelay.gateway.control.placement import PLACEMENT, LoadError, instance_state
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.state import CONFIG

log = logging.getLogger("kvrelay.gateway")

CHECK_EVERY_S = 0.5  # a fresh read of the workers: cheap, and a load takes seconds anyway
_READS = ("loading", "ready", "draining")  # a worker holding the instance so reads (or will read) its stream


class ReloadWatch:
    def __init__(self, app: web.Application, instance: str, served_name: str, deadline: float):
        self._app = app
        self._deadline = deadline  # unix seconds: the request's own
        self.instance = instance  # what the jobs were queued for ("name@3", or a direct model's name)
        self.served_name = served_name  # what the client asked for
        self._checked = 0.0
        self._load: asyncio.Task | None = None
        self._load_started = 0.0  # unix seconds
        self.reloads = 0

    @property
    def hold_until(self) -> float:
        """Unix seconds the request may run to once its model was loaded again: the reload's own limit,
        never past the workers' backstop for its jobs (its deadline plus that limit); 0 without a reload."""
        if not self.reloads:
            return 0.0
        limit = self._app[CONFIG].model_load_timeout
        return min(self._load_started, self._deadline) + limit

    async def check(self) -> None:
        """Called while the request's jobs wait unheard in Redis. Starts the model's load when live workers no
        longer hold both halves of it; raises APIError (503) when that load failed."""
        if self._load is not None and self._load.done():
            load, self._load = self._load, None
            exc = load.exception()
            if isinstance(exc, LoadError):
                raise APIError(503, f"model `{self.served_name}` was unloaded while this request was queued, and "
                                    f"could not be loaded again: {exc}", code="model_unavailable",
                               headers={"Retry-After": str(self._app[CONFIG].retry_after_s)})
            if exc is not None:
                raise exc
        now = time.monotonic()
        if self._load is not None or now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        holders = [w for w in await self._app[WORKER_REGISTRY].workers(fresh=True)
                   if instance_state(w, self.instance) in _READS]
        if any(w.can_prefill for w in holders) and any(w.can_decode for w in holders):
            return  # both halves are held: its workers will read the jobs and answer them
        spec = await self._app[MODEL_REGISTRY].spec(self.served_name)
        if spec is None or spec.instance != self.instance:
            return  # unregistered or swapped meanwhile: nothing to load for these jobs; the deadline ends them
        log.info("%s left its workers while a request for %s waited in its queue: loading it again",
                 self.instance, self.served_name)
        self.reloads += 1
        self._load_started = time.time()
        self._load = asyncio.get_running_loop().create_task(
            self._app[PLACEMENT].ensure_loaded(spec, self._app[CONFIG].model_load_timeout, request=True))
        # a request that ends first never reads the outcome: taken here, so a failure is not logged as lost
        self._load.add_done_callback(lambda task: task.cancelled() or task.exception())

    def cancel(self) -> None:
        """The request ended: stop waiting (the load itself goes on, shielded, for whoever else waits)."""
        if self._load is not None and not self._load.done():
            self._load.cancel()
