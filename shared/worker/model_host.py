"""Several models in one worker process: loading, unloading, eviction and keep-alive, over one KV pool.

Lifecycle of one model instance (a model at one version) here:
  ControlCommand "load" (or a model configured at startup)
    -> the path and every file of the version are resolved inside the repository (``confined``, checked
       again when the load starts, each file opened by its resolved path) and the weights are estimated
       from the safetensors headers (a tensor- or pipeline-parallel group: checked, and each rank's shard
       sized, one placement counted as shared/worker/model_memory.py says); what does not fit the weights budget or the KV pool's floor evicts
       unpinned instances by demand x reload cost (shared/worker/eviction.py: idle ones first; a busy one
       only for a load in higher demand that requests wait for, drained first: the load starts once it is
       gone), or the load waits for room a bounded while if requests wait for it, or is refused
    -> LOADING: a thread verifies the manifest checksums and builds the EngineCore; its KV comes from
       the shared pool (``shared/engine/kv_pool.py``), which lends idle co-resident models' blocks to busy ones
    -> READY: published; the role serves its stream / handoffs
    -> "unload" (drain=True, a swap's old version), keep-alive expiry, or eviction for room
    -> DRAINING: the role finishes what is queued and in flight (``RoleHooks.may_unload``); evicted while
       busy: its stream is no longer read (``reading``) and only what runs here finishes (``RoleHooks.busy``),
       its queued jobs stay in Redis for its next load
    -> gone: KV chunks back to the pool, weights freed (shared weights: once no process on the device maps
       them, shared/worker/shared_weights.py, which also says how a shared model is counted once per device).
A failed load leaves the instance in state "failed" with the error for the admin API, for FAILED_KEEP_S.

The KV pool may commit its own size plus whatever of the weights budget no weights use (``_kv_cap``): an
unload raises its cap (its models grow into the freed memory as they need it), and a load's room is made
before its weights are read: ``make_room`` counts the KV the pool could give back under the lower cap,
and the build starts only once the pool is within it (blocks in use are waited for, up to drain_timeout_s).

Threads: the control listener only moves commands into ``commands``; loads run on their own thread and
touch the pool only under ``lock``, which the worker's loop holds around each step, so the engine's
tensors and the pool's bookkeeping are only ever changed by one thread at a time.
"""

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrelay.shared.config.common import DRAIN_TIMEOUT_S
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_dtype import check_device
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.ranks.checks import group_size_name
from kvrelay.shared.engine.warmup import warm_up
from kvrelay.shared.repo.model_repo import ModelRepository, RepositoryError
from kvrelay.shared.repo.verified_files import verify_parallel
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult, InstanceStatus
from kvrelay.shared.worker.eviction import (
    Candidate,
    DemandRate,
    Incoming,
    choose_victims,
    waiting_demand,
)
from kvrelay.shared.worker.gc_freeze import collect_all, freeze_long_lived
from kvrelay.shared.worker.model_memory import kv_floor_bytes, plan_weight_bytes
from kvrelay.shared.worker.model_slot import ModelPlan, ModelSlot, RoleHooks, group_status
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.step_lock import LockedPool, StepLock

log = logging.getLogger(__name__)

FAILED_KEEP_S = 300.0
KEEP_ALIVE_CHECK_S = 1.0
IDLE_GRACE_S = 1.0  # an instance used this recently is never "idle", whatever its queues say
# A load requests wait for, with no room yet, waits this long for some (a busy model passing its minimum
# residency, or an idle one its queue has emptied, eviction.py) before it is refused: twice the shortest residency.
ROOM_WAIT_S = 30.0


@dataclass
class _Loading:
    plan: ModelPlan
    command_ids: list[str]
    started: float
    thread: threading.Thread | None = None
    slot: ModelSlot | None = None
    error: str = ""
    evicted: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)  # busy victims draining: the build starts once they are gone
    command: ControlCommand | None = None  # kept while it waits for room, to try again
    wait_until: float = 0.0  # monotonic: waiting for room or for its victims' drain ends here, refused
    failed: bool = False
    waiting: int = 0  # requests waiting for it: counted as its first arrivals once it is ready


class ModelHost:
    def __init__(self, base: EngineConfig, *, hold_finished_kv: bool, pool: KVPool | None,
                 weights_budget: int, repo: ModelRepository | None = None,
                 configured_paths: dict[str, str] | None = None, verify_checksums: bool = True,
                 eos_ids: Callable[[EngineCore, str], list[int]] | None = None,
                 report: Callable[[ControlResult], None] | None = None,
                 min_replicas: Callable[[str], int] | None = None, freeze_gc: bool = False,
                 skip_warmup: bool = False, shared: SharedWeights | None = None,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, parallel_sizes: dict[str, tuple[int, int]] | None = None):
        """``eos_ids(core, path)`` gives an instance's stop ids; ``report(ControlResult)`` answers a command;
        ``min_replicas(name)`` reads the registry (keep-alive never unloads a model kept at a minimum).
        ``freeze_gc``: this process is a worker, so loaded models may leave the garbage collector's view
        (shared/worker/gc_freeze.py); never in a process that is not ours alone. Each instance runs its
        warm-up (shared/engine/warmup.py) before it is ready, unless ``skip_warmup``. ``shared``: weights are
        shared with the other worker processes on this device (shared/worker/shared_weights.py).
        ``drain_timeout_s``: what a busy model evicted for a load gives its running requests to finish, as a
        SIGTERM drain gives a worker's (--drain-timeout). ``parallel_sizes``: name -> (tensor_parallel_size,
        pipeline_parallel_size) of the models the config file gives their own; the others take ``base``'s."""
        self.drain_timeout_s = drain_timeout_s
        self.base = base
        self.hold_finished_kv = hold_finished_kv
        self.pool = pool
        self.weights_budget = weights_budget
        self.repo = repo
        self.configured_paths = dict(configured_paths or {})  # name -> path the operator configured
        self.parallel_sizes = dict(parallel_sizes or {})
        self.verify_checksums = verify_checksums
        self.freeze_gc = freeze_gc
        self.skip_warmup = skip_warmup
        self.shared = shared
        self._checked_shared = 0.0
        self._eos_ids = eos_ids or (lambda core, path: [])
        self._report = report or (lambda result: None)
        self._min_replicas = min_replicas or (lambda name: 0)
        self.slots: dict[str, ModelSlot] = {}
        self.loading: dict[str, _Loading] = {}
        self.failed: dict[str, tuple[str, str, int, float]] = {}  # instance -> (error, name, version, when)
        self.commands: queue.Queue[ControlCommand] = queue.Queue()
        self.lock = StepLock()
        self.hooks: RoleHooks | None = None
        self._checked_keep_alive = 0.0
        self._demand: dict[str, DemandRate] = {}  # instance -> its rate while it was here (a reload's demand)
        self._deferred: list[ControlCommand] = []  # loads of an instance still draining out for an eviction

    # -- planning -------------------------------------------------------------------------------
    def plan(self, cmd: ControlCommand) -> ModelPlan:
        """Resolve and check a load command; RepositoryError/ValueError say why it cannot be loaded."""
        if cmd.version:
            if self.repo is None:
                raise RepositoryError("this worker has no model repository (start it with --model-repo)")
            mv = self.repo.get(cmd.name, cmd.version)  # confined: no "..", absolute path or escaping link
            path, root = mv.path, self.repo.root
            verify = (lambda: verify_parallel(mv, self.repo)) if self.verify_checksums else None
        else:
            path = self.configured_paths.get(cmd.name, "")
            if not path or (cmd.path and cmd.path != path):
                raise RepositoryError(f"model {cmd.name!r} has no version and no path configured on this worker")
            verify, root = None, None
        model = dataclasses.replace(self.base.model, model=path, served_model_name=cmd.name,
                                    dtype=cmd.dtype or self.base.model.dtype,
                                    quantization=cmd.quantization or self.base.model.quantization,
                                    max_model_len=cmd.max_model_len or self.base.model.max_model_len,
                                    load_format="dummy" if path.startswith("dummy:") else "auto")
        cache = dataclasses.replace(self.base.cache, kv_cache_dtype=cmd.kv_cache_dtype or self.base.cache.kv_cache_dtype)
        tp, pp = self.parallel_sizes.get(cmd.name, (self.base.tensor_parallel_size, self.base.pipeline_parallel_size))
        engine = dataclasses.replace(self.base, model=model, cache=cache, tensor_parallel_size=tp,
                                     pipeline_parallel_size=pp)
        check_device(cache.kv_cache_dtype, torch.device(engine.device))  # before any weight is read
        return self._sized(ModelPlan(name=cmd.name, version=cmd.version, path=path, engine=engine, pinned=cmd.pinned,
                                     keep_alive_s=cmd.keep_alive_s, verify=verify, root=root))

    @staticmethod
    def _sized(plan: ModelPlan) -> ModelPlan:
        """``plan`` with its weights estimated (a group checked first and counted as model_memory says)."""
        plan.weight_bytes, plan.rank_weight_bytes = plan_weight_bytes(plan.engine, plan.root)
        return plan

    @property
    def weights_used(self) -> int:
        if self.shared is None:
            return (sum(s.weight_bytes for s in self.slots.values())
                    + sum(ld.plan.weight_bytes for ld in self.loading.values() if ld.command is None))
        # the device's shared models once each (whoever loaded them), plus what only this process holds
        return (self.shared.device_bytes()
                + sum(s.weight_bytes for s in self.slots.values() if not self.shared.how(s.instance))
                + sum(ld.plan.weight_bytes for ld in self.loading.values()
                      if ld.command is None and not self._on_device(ld.plan)))

    def _on_device(self, plan: ModelPlan) -> bool:
        """``plan``'s weights are already shared on this device (loading it maps them: no new memory). Never
        a tensor- or pipeline-parallel group's: its ranks each load their own shard."""
        return (self.shared is not None and plan.engine.tensor_parallel_size * plan.engine.pipeline_parallel_size == 1
                and self.shared.on_device(self.shared.key(plan.engine)))

    def make_room(self, plan: ModelPlan, evict: bool, prefer: list[str] = (), waiting: int = 0) -> list[str]:
        """Evict what ``plan`` needs room for, as shared/worker/eviction.py chooses; the victims' keys. Idle
        victims are unloaded now; busy ones stop reading their streams and are unloaded by ``tick`` once
        what runs for them finished (the load waits for that). ``waiting``: requests waiting for this load.
        Raises ValueError (nothing evicted) when even every eligible victim would not be enough."""
        weights = 0 if self._on_device(plan) else plan.weight_bytes
        need = weights - (self.weights_budget - self.weights_used)
        floor = self._floor_bytes(plan)
        # the KV pool gives back what it borrowed of the weights budget (kv_cap), keeping what is in use
        cap = self._kv_cap(weights)
        # a group's KV stays within the pool's own size (its other ranks' caches mirror it: model_runner.py)
        within = plan.engine.tensor_parallel_size * plan.engine.pipeline_parallel_size > 1
        kv_short = 0 if self.pool is None else floor - self.pool.reclaimable_bytes(cap, within)
        if need <= 0 and kv_short <= 0:
            return []
        now = time.monotonic()
        load = Incoming(self.demand_of(plan.instance, now) + waiting_demand(waiting), waiting)
        candidates = [Candidate(instance=s.instance, weight_bytes=s.weight_bytes, kv_bytes=self._owned_bytes(s),
                                reload_s=s.load_s, demand=s.demand.rate(now), resident_s=now - s.loaded_at,
                                idle=self._evictable(s), pinned=s.pinned, ready=s.state == "ready" and s.reading,
                                preferred=s.instance in prefer, idle_s=s.idle_s)
                      for s in self.slots.values()]
        chosen = choose_victims(candidates, need, kv_short, load)
        if chosen is None or (chosen and not evict):
            gib = 2**30
            raise ValueError(
                f"not enough memory to load {plan.instance}: needs {plan.weight_bytes / gib:.2f} GiB of weights "
                + (f"({group_size_name(plan.engine)}: its {'largest shard' if plan.engine.device.startswith('cuda') else 'shards'}) "
                   if plan.rank_weight_bytes else "")
                + f"(free {(self.weights_budget - self.weights_used) / gib:.2f} of {self.weights_budget / gib:.2f} GiB)"
                + ("" if self.pool is None else f" and {floor / gib:.3f} GiB of KV (reclaimable "
                   f"{self.pool.reclaimable_bytes(cap, within) / gib:.3f} GiB)")
                + ("; no idle unpinned model, nor a busy one in lower demand (eviction.py), frees enough"
                   if evict else "; eviction not allowed"))
        for c in chosen:
            s = self.slots[c.instance]
            if c.idle:
                log.info("evicting %s (idle %.0fs, reload cost %.1fs) to make room for %s",
                         s.instance, s.idle_s, s.load_s, plan.instance)
                self.unload_now(s.instance)
            else:
                log.info("evicting %s (busy, %.2f req/s, reload cost %.1fs) for %s (%.2f req/s, %d waiting): "
                         "draining it first", s.instance, c.demand, s.load_s, plan.instance, load.demand, waiting)
                s.state, s.reading = "draining", False
        return [c.instance for c in chosen]

    def _kv_cap(self, loading: int = 0) -> int:
        """What the KV pool may commit: its own size plus the weights budget no model's weights use (nor
        ``loading`` more bytes of them), so KV grows into what unloaded models free and gives it back to loads."""
        return self.pool.base_bytes + max(0, self.weights_budget - self.weights_used - loading)

    def _sync_cap(self) -> bool:
        """Move the pool's cap to ``_kv_cap``: False while blocks in use keep it above (shared/engine/kv_pool.py)."""
        if self.pool is None:
            return True
        with self.lock:  # a loading thread attaches under it
            return self.pool.set_cap(self._kv_cap())

    def demand_of(self, instance: str, now: float) -> float:
        """Its requests' arrival rate here: while hosted, or as it was when it left."""
        slot = self.slots.get(instance)
        rate = slot.demand if slot is not None else self._demand.get(instance)
        return rate.rate(now) if rate is not None else 0.0

    def _evictable(self, s: ModelSlot) -> bool:
        return (not s.pinned and s.state == "ready" and s.idle_s > IDLE_GRACE_S
                and (self.hooks is None or self.hooks.idle(s)))

    def _floor_bytes(self, plan: ModelPlan) -> int:
        if self.pool is None:
            return 0
        return kv_floor_bytes(plan.engine, plan.root)

    def _owned_bytes(self, s: ModelSlot) -> int:
        return s.core.num_total_blocks * s.core.block_bytes

    # -- loading --------------------------------------------------------------------------------
    def load_now(self, plan: ModelPlan) -> ModelSlot:
        """Synchronous load (models configured at startup); raises on failure."""
        if plan.engine.tensor_parallel_size * plan.engine.pipeline_parallel_size > 1 and not plan.rank_weight_bytes:
            plan = self._sized(plan)  # checked, and its shards sized for the budget and the status
        slot = self._build(plan)
        self._ready(slot)
        return slot

    def _build(self, plan: ModelPlan) -> ModelSlot:
        t0 = time.perf_counter()
        if plan.root is not None and self.repo is not None:
            self.repo.get(plan.name, plan.version)  # again: a file may have become a link since the plan
        if plan.verify is not None:
            plan.verify()
        log.info("loading %s from %s", plan.instance, plan.path)
        # weights are read here while the other models keep serving; the engine around them is built
        # under the lock on CUDA, where capturing CUDA graphs (and the sync checks around it) must not
        # race another thread's kernels, and warmed up taking it shape by shape, so the co-resident
        # models step between shapes. On CPU only the pool attach takes the lock (LockedPool).
        tp, pp = plan.engine.tensor_parallel_size, plan.engine.pipeline_parallel_size
        if tp * pp > 1:  # each rank process loads its own shard (or stage): the engine starts them and loads
            loaded, how = None, (f"loaded as {tp} tensor-parallel shards" if pp == 1 else f"loaded as {pp} pipeline stages")
        elif self.shared is None:
            loaded, how = load_model(plan.engine.model, plan.engine.device, root=plan.root), "loaded"
        else:  # mapped from another worker process on this device, or loaded here and exported to them
            loaded, how = self.shared.load(plan.engine, plan.instance, plan.root)
        t_weights = time.perf_counter()
        cuda = plan.engine.device.startswith("cuda")
        with self.lock if cuda else contextlib.nullcontext():
            core = EngineCore(plan.engine, hold_finished_kv=self.hold_finished_kv,
                              kv_pool=LockedPool(self.pool, self.lock) if self.pool is not None else None,
                              kv_pool_key=plan.instance, loaded=loaded, model_root=plan.root)
        try:
            if not self.skip_warmup:  # before ready: the first requests must not pay for compiles
                warm_up(core, decode=not self.hold_finished_kv, compiles=cuda, hold=self.lock if cuda else None)
        except BaseException:
            core.release_kv()
            if self.shared is not None:
                self.shared.release(plan.instance)
            raise
        # a group counts every device it occupies (model_memory.group_weight_bytes), this process holds rank 0's
        # shard alone; the estimate is each rank's model built on the meta device, the same shapes it loaded
        weight_bytes = core.weight_bytes if tp * pp == 1 else plan.weight_bytes
        log.info("%s: weights %s in %.2fs, engine (KV attach, graphs%s) in %.2fs", plan.instance, how,
                 t_weights - t0, "" if self.skip_warmup else ", warm-up", time.perf_counter() - t_weights)
        return ModelSlot(instance=plan.instance, name=plan.name, version=plan.version, path=plan.path, core=core,
                         eos_ids=self._eos_ids(core, plan.path), pinned=plan.pinned,
                         keep_alive_s=plan.keep_alive_s, load_s=time.perf_counter() - t0,
                         weight_bytes=weight_bytes, rank_weight_bytes=plan.rank_weight_bytes)

    def _ready(self, slot: ModelSlot) -> None:
        if self.freeze_gc:
            freeze_long_lived()  # the new model's objects live until its unload
        slot.demand = self._demand.pop(slot.instance, slot.demand)  # its demand before it left
        slot.loaded_at = time.monotonic()
        self.slots[slot.instance] = slot
        self.failed.pop(slot.instance, None)
        if self.hooks is not None:
            self.hooks.attach(slot)
        log.info("%s ready (%.1f GiB of weights, loaded in %.2fs)", slot.instance, slot.weight_bytes / 2**30,
                 slot.load_s)

    def _start_load(self, cmd: ControlCommand) -> None:
        inst = cmd.instance
        if inst in self.slots:
            slot = self.slots[inst]
            if not slot.reading:  # evicted while busy and still finishing: loaded again once it is gone
                self._deferred.append(cmd)
                return None
            if slot.state == "draining":  # asked back before it left: keep serving it
                slot.state = "ready"
            slot.pinned = slot.pinned or cmd.pinned
            return self._answer(cmd, True)
        if inst in self.loading:
            self.loading[inst].command_ids.append(cmd.command_id)
            return None
        t0 = time.perf_counter()
        try:
            plan = self.plan(cmd)
        except (RepositoryError, ValueError, OSError) as exc:
            self.failed[inst] = (str(exc), cmd.name, cmd.version, time.time())
            return self._answer(cmd, False, str(exc), time.perf_counter() - t0)
        ld = _Loading(plan, [cmd.command_id], time.perf_counter(), command=cmd, waiting=cmd.waiting,
                      wait_until=time.monotonic() + (ROOM_WAIT_S if cmd.waiting > 0 else 0.0))
        self.loading[inst] = ld  # first: once room is made its weights count (weights_used, the KV cap)
        self._advance(ld)
        if ld.failed and ld.thread is None and not ld.after:  # no room, and none to wait for: refused now
            del self.loading[inst]
            self.failed[inst] = (ld.error, cmd.name, cmd.version, time.time())
            return self._answer(cmd, False, ld.error, time.perf_counter() - t0)

    def _advance(self, ld: _Loading) -> None:
        """Make room (a load requests wait for may wait for it until ``wait_until``: a busy model passing its
        minimum residency), wait for the busy victims' drain (up to drain_timeout_s), then start the build.
        ``ld.failed`` with ``ld.error`` when it gives up."""
        if ld.thread is not None or ld.failed:
            return
        now = time.monotonic()
        if ld.command is not None:
            cmd = ld.command
            try:
                ld.evicted = self.make_room(ld.plan, cmd.evict, cmd.prefer_evict, cmd.waiting)
            except ValueError as exc:
                ld.error, ld.failed = str(exc), now >= ld.wait_until
                return
            ld.command, ld.error, ld.wait_until = None, "", now + self.drain_timeout_s
            ld.after = [v for v in ld.evicted if v in self.slots]  # busy victims, draining
            self._sync_cap()  # its weights count now: the pool gives back its share, or stops growing into it
        ld.after = [v for v in ld.after if v in self.slots]
        if ld.after and now >= ld.wait_until:
            for victim in ld.after:  # did not drain in time: it serves on, and the load is refused
                slot = self.slots[victim]
                slot.state, slot.reading = "ready", True
            ld.error = (f"not loading {ld.plan.instance}: {', '.join(ld.after)} (evicted for it) did not finish "
                        f"its running requests within {self.drain_timeout_s:.0f}s")
            ld.failed, ld.after = True, []
        if ld.after or ld.failed:
            return
        if not self._sync_cap():  # KV blocks still in use where the weights go: wait for them, boundedly
            ld.error = (f"not loading {ld.plan.instance}: the KV pool could not give back the memory its weights "
                        f"need (in use by running requests) within {self.drain_timeout_s:.0f}s")
            ld.failed = now >= ld.wait_until
            return
        ld.thread = threading.Thread(target=self._load_thread, args=(ld,), daemon=True,
                                     name=f"load-{ld.plan.instance}")
        ld.thread.start()

    def _load_thread(self, ld: _Loading) -> None:
        try:
            ld.slot = self._build(ld.plan)
        except Exception as exc:  # any failure to load is this instance's, never the worker's
            log.warning("loading %s failed: %s", ld.plan.instance, exc, exc_info=True)
            ld.error = f"loading {ld.plan.instance} failed: {exc}"
            ld.failed = True

    def _finish_loads(self) -> bool:
        changed = False
        for inst, ld in list(self.loading.items()):
            self._advance(ld)
            if not ld.failed and (ld.thread is None or ld.thread.is_alive()):
                continue  # waiting for room or for its victims, or building
            del self.loading[inst]
            changed = True
            seconds = time.perf_counter() - ld.started
            if ld.slot is not None:
                self._ready(ld.slot)
                # the requests that waited count as its first arrivals (admitted, they count again: its demand
                # errs high for a while, so the reload it displaced cannot evict it before they were seen)
                ld.slot.demand.note(time.monotonic(), ld.waiting)
            else:
                self.failed[inst] = (ld.error, ld.plan.name, ld.plan.version, time.time())
                _release_memory()
            for cid in ld.command_ids:
                self._report(ControlResult(command_id=cid, worker_id="", instance=inst, ok=ld.slot is not None,
                                           error=ld.error, seconds=seconds, evicted=ld.evicted))
        if changed:
            self._sync_cap()  # the estimate made room; now its real weights count, or (failed) none
        return changed

    # -- unloading ------------------------------------------------------------------------------
    def unload_now(self, instance: str) -> None:
        slot = self.slots.pop(instance)
        self._demand[instance] = slot.demand  # its next load's demand (eviction.py)
        if self.hooks is not None:
            self.hooks.detach(slot)
        slot.core.release_kv()
        slot.core = None  # drop the last reference before collecting
        _release_memory()
        if self.shared is not None:
            self.shared.release(instance)  # after the tensors are gone: the last user frees the segment
        self._sync_cap()  # its weights' memory is the KV pool's to grow into (after empty_cache gave it back)
        log.info("unloaded %s", instance)

    def _unload(self, cmd: ControlCommand) -> None:
        inst = cmd.instance
        slot = self.slots.get(inst)
        if slot is None:
            self.failed.pop(inst, None)
            return self._answer(cmd, True)  # idempotent: not here
        if cmd.drain or (self.hooks is not None and not self.hooks.idle(slot)):
            slot.state = "draining"  # tick() unloads it once nothing is queued or in flight for it
            return self._answer(cmd, True)
        self.unload_now(inst)
        return self._answer(cmd, True)

    # -- the loop's hook ------------------------------------------------------------------------
    def tick(self) -> bool:
        """Commands, finished loads, completed drains, keep-alive. True when what we advertise changed."""
        changed = False
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            changed = True
            if cmd.op == "load":
                self._start_load(cmd)
            else:
                self._unload(cmd)
        changed |= self._finish_loads()
        for slot in list(self.slots.values()):
            if slot.state != "draining" or self.hooks is not None and (
                    self.hooks.busy(slot) if not slot.reading else not self.hooks.may_unload(slot)):
                continue
            self.unload_now(slot.instance)
            changed = True
        # an evicted one asked back: loaded again once it is gone, or answered if it serves on (drain timed out)
        for cmd in [c for c in self._deferred if c.instance not in self.slots or self.slots[c.instance].reading]:
            self._deferred.remove(cmd)
            self._start_load(cmd)
            changed = True
        now = time.monotonic()
        if self.shared is not None and now - self._checked_shared > KEEP_ALIVE_CHECK_S:
            self._checked_shared = now
            self.shared.check_exporters()  # CUDA: raises when mapped memory died with its exporter
        if now - self._checked_keep_alive > KEEP_ALIVE_CHECK_S:
            self._checked_keep_alive = now
            changed |= self._keep_alive()
            self._sync_cap()  # a shared model another process held may have left the device (not every
            # step: counting shared weights reads the device's registry file)
        for inst in [i for i, f in self.failed.items() if time.time() - f[3] > FAILED_KEEP_S]:
            del self.failed[inst]
        return changed

    def _keep_alive(self) -> bool:
        expired = [s for s in self.slots.values() if s.keep_alive_s > 0 and s.idle_s > s.keep_alive_s
                   and self._evictable(s)]
        for s in expired:
            if self._min_replicas(s.name) > 0:
                continue
            log.info("%s idle for %.0fs (keep-alive %.0fs): unloading", s.instance, s.idle_s, s.keep_alive_s)
            self.unload_now(s.instance)
        return bool(expired)

    def _answer(self, cmd: ControlCommand, ok: bool, error: str = "", seconds: float = 0.0) -> None:
        self._report(ControlResult(command_id=cmd.command_id, worker_id="", instance=cmd.instance, ok=ok,
                                   error=error, seconds=seconds))

    # -- what the heartbeat says ----------------------------------------------------------------
    def status(self) -> list[InstanceStatus]:
        out = []
        lendable = self.pool.reclaimable_bytes() if self.pool is not None else 0  # what the pool could add
        for s in self.slots.values():
            out.append(InstanceStatus(instance=s.instance, name=s.name, version=s.version, state=s.state,
                                      weight_bytes=s.weight_bytes, kv_blocks=s.core.num_total_blocks,
                                      kv_free_blocks=s.core.num_free_blocks + lendable // s.core.block_bytes,
                                      running=s.core.num_running,
                                      waiting=s.core.num_waiting, idle_s=round(s.idle_s, 3), pinned=s.pinned,
                                      load_s=round(s.load_s, 3),
                                      engine=s.metrics.engine_stats() if s.metrics is not None else None,
                                      **group_status(s.core.config, s.core.rank_processes(), s.rank_weight_bytes or [s.weight_bytes])))
        for inst, ld in self.loading.items():
            out.append(InstanceStatus(instance=inst, name=ld.plan.name, version=ld.plan.version, state="loading",
                                      weight_bytes=ld.plan.weight_bytes, pinned=ld.plan.pinned,
                                      **group_status(ld.plan.engine, [], ld.plan.rank_weight_bytes)))
        for inst, (error, name, version, _) in self.failed.items():
            if inst not in self.slots and inst not in self.loading:
                out.append(InstanceStatus(instance=inst, name=name, version=version, state="failed",
                                          error=error[:2000]))
        return out


def _release_memory() -> None:
    collect_all()  # the unloaded model's objects may have been frozen with everything else
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
