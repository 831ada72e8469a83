"""Where model instances get loaded, and the control commands that load, unload and swap them.

The gateway never loads anything itself: it LPUSHes a ``ControlCommand`` to a worker's control list and
polls for the ``ControlResult``. The worker estimates memory, evicts idle unpinned instances when
allowed, and answers ok or why not ("not enough memory: ..."); the gateway then tries the next worker.

One load per instance across gateways: whoever wins ``load_lock_key`` (SET NX) places it, the others
wait for readiness. A failed load leaves its reason under the lock for a moment, so the requests that
waited (on every gateway) answer with the worker's reason, and a burst of requests for a model nobody
can load does not turn into a burst of load attempts. Every readiness check reads Redis, not a cache.

Which model a load evicts is decided in ONE place, the worker (shared/worker/eviction.py): only it knows
its memory, which of its instances are busy and how fast requests arrive for each. What it cannot see is
how many requests wait for the load: a lazy load's requests wait here before any job is queued. So each
load command carries that count (``ControlCommand.waiting``: this gateway's requests waiting on the load,
plus the jobs queued for the instance in Redis, whoever queued them) and no eviction policy lives here.
"""

import asyncio
import dataclasses
import logging
import time
import uuid

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.control.model_registry import ModelRegistry, SpecConflict
from kvrelay.gateway.control.worker_registry import WorkerRegistry
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.priority_bands import shared_streams
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult, ModelSpec, WorkerInfo, instance_key

log = logging.getLogger("kvrelay.gateway")

POLL_S = 0.05  # control results and readiness: a load takes seconds, a poll costs one GET
FAILURE_MEMO_S = 2  # how long a failed load's reason answers for the instance before a retry
_LIVENESS_EVERY_S = 1.0  # while waiting for a result: is the worker still there at all?
_FAILED = b"failed:"
HOLDING = ("loading", "ready")

# Compare-and-act on the lock: only the gateway that took it may release it or leave its failure there.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_MEMO = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('set', KEYS[1], ARGV[2], 'EX', "
         "ARGV[3]) end return 0")


class LoadError(Exception):
    """No worker could load the instance; the message says why, in the workers' own words."""


def instance_state(worker: WorkerInfo, instance: str) -> str | None:
    for status in worker.instances:
        if status.instance == instance:
            return status.state
    # workers without per-instance status (a worker started with --model) list only what is ready
    return "ready" if instance in worker.models else None


def serves_role(worker: WorkerInfo, role: str) -> bool:
    return worker.can_prefill if role == "prefill" else worker.can_decode


def _preference(worker: WorkerInfo) -> tuple[int, int]:
    # most free budget first (its models' weights, their measured overheads and its step reserve taken out),
    # then the fewest co-resident instances (least KV contention)
    free = worker.weights_budget - worker.weights_used - worker.overhead_used
    return -free, len(worker.instances) or len(worker.models)


def load_command(spec: ModelSpec, prefer_evict: list[str] = (), waiting: int = 0) -> ControlCommand:
    return ControlCommand(command_id=uuid.uuid4().hex, op="load", name=spec.name, version=spec.version,
                          path=spec.path, dtype=spec.dtype, quantization=spec.quantization,
                          kv_cache_dtype=spec.kv_cache_dtype,
                          max_model_len=spec.max_model_len, pinned=spec.pinned,
                          keep_alive_s=spec.keep_alive_s, prefer_evict=list(prefer_evict), waiting=waiting)


class Placement:
    def __init__(self, client: redis.asyncio.Redis, registry: WorkerRegistry):
        self._redis = client
        self._registry = registry
        # concurrent requests on this gateway for one instance share one placement
        self._inflight: dict[tuple[str, int], asyncio.Task] = {}
        self._waiters: dict[str, int] = {}  # instance -> requests on this gateway waiting for its load

    # -- control commands ------------------------------------------------------------------------

    async def command(self, worker_id: str, cmd: ControlCommand, deadline: float) -> ControlResult:
        """Send ``cmd`` and wait (until ``deadline``, monotonic) for the worker's answer. A worker that
        dies or never answers yields ok=False, and a command it never picked up is taken back."""
        payload = encode(cmd)
        await self._redis.lpush(keys.control_key(worker_id), payload)
        checked = time.monotonic()
        while time.monotonic() < deadline:
            data = await self._redis.get(keys.control_result_key(cmd.command_id))
            if data is not None:
                return decode(data, ControlResult)
            if time.monotonic() - checked >= _LIVENESS_EVERY_S:
                checked = time.monotonic()
                if not await self._redis.exists(keys.worker_key(worker_id)):
                    break
            await asyncio.sleep(POLL_S)
        taken_back = await self._redis.lrem(keys.control_key(worker_id), 1, payload)
        why = "stopped" if not await self._redis.exists(keys.worker_key(worker_id)) else "did not answer in time"
        if not taken_back:
            why += " (it had taken the command)"
        return ControlResult(command_id=cmd.command_id, worker_id=worker_id, instance=cmd.instance, ok=False,
                             error=f"worker {worker_id} {why}")

    async def send(self, worker_id: str, cmd: ControlCommand) -> None:
        """Fire and forget: the result appears at ``control_result_key(cmd.command_id)``."""
        await self._redis.lpush(keys.control_key(worker_id), encode(cmd))

    async def unload(self, name: str, version: int, drain: bool = True) -> list[dict]:
        """Ask every live worker holding the instance (in any state) to unload it; don't wait, a drain
        lasts as long as the requests it lets finish."""
        instance = instance_key(name, version)
        sent = []
        for worker in await self._registry.workers(fresh=True):
            if instance_state(worker, instance) is None:
                continue
            cmd = ControlCommand(command_id=uuid.uuid4().hex, op="unload", name=name, version=version, drain=drain)
            await self.send(worker.worker_id, cmd)
            sent.append({"worker_id": worker.worker_id, "instance": instance, "command_id": cmd.command_id})
        return sent

    # -- readiness -------------------------------------------------------------------------------

    async def servable(self, instance: str, replicas: int = 1) -> bool:
        """``replicas`` live workers per role hold it ready, and its ModelInfo (the tokenizer) is out."""
        workers = await self._registry.workers(fresh=True)
        ready = [w for w in workers if instance_state(w, instance) == "ready"]
        if sum(w.can_prefill for w in ready) < replicas or sum(w.can_decode for w in ready) < replicas:
            return False
        return await self._registry.model(instance, fresh=True) is not None

    async def _wait_ready(self, instance: str, replicas: int, placed: set[str], deadline: float) -> None:
        while True:
            if await self.servable(instance, replicas):
                self._registry.invalidate()
                return
            live = {w.worker_id: w for w in await self._registry.workers(fresh=True)}
            for worker_id in placed:
                worker = live.get(worker_id)
                if worker is None:
                    raise LoadError(f"worker {worker_id} stopped while loading {instance}")
                for status in worker.instances:
                    if status.instance == instance and status.state == "failed":
                        raise LoadError(f"{worker_id}: {status.error or 'load failed'}")
            if time.monotonic() >= deadline:
                raise LoadError(f"{instance} was not ready in time")
            await asyncio.sleep(POLL_S)

    # -- loading ---------------------------------------------------------------------------------

    async def ensure_loaded(self, spec: ModelSpec, timeout: float, replicas: int = 1, retry: bool = False,
                            request: bool = False) -> None:
        """Return once ``spec.instance`` is servable by ``replicas`` workers per role; LoadError when no
        worker can take it, the load fails, or ``timeout`` passes. ``retry`` ignores a recent failure
        (an operator asking again). ``request``: a client request waits on it (the load's demand)."""
        key = (spec.instance, replicas)
        if request:
            self._waiters[spec.instance] = self._waiters.get(spec.instance, 0) + 1
        task = self._inflight.get(key)
        if task is None or retry:
            task = asyncio.get_running_loop().create_task(self._ensure(spec, timeout, replicas, retry))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._inflight.pop(key, None) if self._inflight.get(key) is t else None)
        try:
            # shielded: one impatient (disconnected) request must not cancel the load the others wait on
            async with asyncio.timeout(timeout):
                await asyncio.shield(task)
        except TimeoutError:
            raise LoadError(f"{spec.instance} was not ready within {timeout:g}s") from None
        finally:
            if request:
                left = self._waiters.pop(spec.instance, 1) - 1
                if left:
                    self._waiters[spec.instance] = left

    async def _ensure(self, spec: ModelSpec, timeout: float, replicas: int, retry: bool) -> None:
        instance, lock = spec.instance, keys.load_lock_key(spec.instance)
        deadline = time.monotonic() + timeout
        while not await self.servable(instance, replicas):
            token = uuid.uuid4().hex
            if retry:
                held = await self._redis.get(lock)
                if held is not None and held.startswith(_FAILED):
                    await self._redis.eval(_RELEASE, 1, lock, held)
            if await self._redis.set(lock, token, nx=True, ex=keys.LOAD_LOCK_TTL_S):
                try:
                    await self._place(spec, replicas, deadline)
                except LoadError as exc:
                    await self._redis.eval(_MEMO, 1, lock, token, _FAILED + str(exc).encode(), FAILURE_MEMO_S)
                    raise
                finally:
                    await self._redis.eval(_RELEASE, 1, lock, token)
                return
            held = await self._redis.get(lock)  # another gateway is placing it: wait, or share its failure
            if held is not None and held.startswith(_FAILED):
                raise LoadError(held[len(_FAILED):].decode(errors="replace"))
            if time.monotonic() >= deadline:
                raise LoadError(f"{instance} was not ready in time (another gateway is loading it)")
            await asyncio.sleep(POLL_S * 2)
        self._registry.invalidate()

    async def _place(self, spec: ModelSpec, replicas: int, deadline: float) -> None:
        instance = spec.instance
        placed: set[str] = set()  # answered ok; their heartbeat may not show it yet
        tried: set[str] = set()
        reasons: list[str] = []
        evicted: list[str] = []  # by the prefill side: the decode side evicts the same, if it must
        for role in ("prefill", "decode"):
            while True:
                workers = [w for w in await self._registry.workers(fresh=True) if serves_role(w, role)]
                # a worker that just refused may still advertise "loading" until its next heartbeat
                held = {w.worker_id for w in workers if w.worker_id in placed or (
                    w.worker_id not in tried and instance_state(w, instance) in HOLDING)}
                if len(held) >= replicas:
                    break
                candidates = sorted((w for w in workers if w.can_load and w.worker_id not in tried | held),
                                    key=_preference)
                if not candidates:
                    if reasons:
                        raise LoadError(f"no worker could load {instance}: " + "; ".join(reasons))
                    raise LoadError(f"no live {role} worker can load models (started with --model-repo) "
                                    f"and has room for {instance}")
                worker = candidates[0]
                tried.add(worker.worker_id)
                log.info("loading %s on %s", instance, worker.worker_id)
                cmd = load_command(spec, evicted, await self._waiting(instance, workers))
                result = await self.command(worker.worker_id, cmd, deadline)
                if result.ok:
                    placed.add(worker.worker_id)
                    evicted += result.evicted
                    if result.evicted:
                        log.info("%s evicted %s to make room for %s", worker.worker_id, result.evicted, instance)
                else:
                    log.warning("%s refused to load %s: %s", worker.worker_id, instance, result.error)
                    reasons.append(f"{worker.worker_id}: {result.error}")
                if time.monotonic() >= deadline:
                    raise LoadError(f"{instance} was not loaded in time" + (": " + "; ".join(reasons) if reasons else ""))
        await self._wait_ready(instance, replicas, placed, deadline)

    async def _waiting(self, instance: str, workers: list[WorkerInfo]) -> int:
        """Requests waiting for ``instance``'s load: ours, and its jobs queued in Redis (shared stream, every
        priority band's, and the workers' private ones)."""
        pipe = self._redis.pipeline(transaction=False)
        for stream in shared_streams(instance):
            pipe.xlen(stream)
        for w in workers:
            pipe.xlen(keys.prefill_worker_stream(instance, w.worker_id))
        return self._waiters.get(instance, 0) + sum(await pipe.execute())

    # -- version swap ----------------------------------------------------------------------------

    async def swap(self, models: ModelRegistry, spec: ModelSpec, version: int, timeout: float,
                   grace_s: float) -> tuple[ModelSpec, list[dict]]:
        """Load ``version`` wherever the active one is loaded, wait until it is servable, flip the spec
        (new requests go to it), wait ``grace_s`` for other gateways' cached specs to follow, then drain
        the old version. On failure the spec is untouched and the half-loaded new version unloaded."""
        old, deadline = spec.version, time.monotonic() + timeout
        new_spec = dataclasses.replace(spec, version=version, previous_version=old)
        old_inst, new_inst = spec.instance, new_spec.instance
        holders = [w for w in await self._registry.workers(fresh=True)
                   if instance_state(w, old_inst) in HOLDING and instance_state(w, new_inst) not in HOLDING]
        results = await asyncio.gather(*(self.command(w.worker_id, load_command(new_spec), deadline)
                                         for w in holders if w.can_load))
        reasons = [f"{r.worker_id}: {r.error}" for r in results if not r.ok]
        try:
            if not reasons and results:
                await self._wait_ready(new_inst, 1, {r.worker_id for r in results}, deadline)
            # also where the old version was loaded nowhere, or some loads failed: anywhere that has room
            await self.ensure_loaded(new_spec, max(deadline - time.monotonic(), POLL_S), retry=True)
        except LoadError as exc:
            await self.unload(spec.name, version, drain=False)
            raise LoadError("; ".join([*reasons, str(exc)])) from None

        def flip(current: ModelSpec) -> ModelSpec:
            if current.version != old:
                raise SpecConflict(f"{spec.name} changed to version {current.version} during the swap")
            return dataclasses.replace(current, version=version, previous_version=old)

        flipped = await models.update(spec.name, flip)
        if flipped is None:
            raise SpecConflict(f"{spec.name} was unregistered during the swap")
        log.info("%s now serves version %d; draining version %d", spec.name, version, old)
        await asyncio.sleep(grace_s)
        return flipped, await self.unload(spec.name, old, drain=True)


PLACEMENT = web.AppKey("placement", Placement)
