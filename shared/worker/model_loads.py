"""Loading a model instance: the plan (its path confined to the repository, its weights estimated), room
made for it (shared/worker/load_room.py), then a thread that verifies the manifest checksums and builds the
EngineCore while the co-resident models keep serving; READY once warmed up, or "failed" with its error.

A load requests wait for, with no room yet, waits for some as long as the hosted models' minimum residency
may keep it (eviction.room_wait_s); a load that evicted busy models waits for their drain (up to
drain_timeout_s) before its build starts.
"""

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.engine.kv_dtype import check_device
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.measured_warmup import warm_up_measured
from kvrelay.shared.engine.warmup import build_engine
from kvrelay.shared.repo.model_repo import ModelRepository, RepositoryError
from kvrelay.shared.repo.verified_files import verify_parallel
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult
from kvrelay.shared.worker import gpu_share
from kvrelay.shared.worker.eviction import DemandRate, room_wait_s
from kvrelay.shared.worker.gc_freeze import collect_all, freeze_long_lived
from kvrelay.shared.worker.gil_switch import short_switches
from kvrelay.shared.worker.model_memory import plan_weight_bytes
from kvrelay.shared.worker.model_overhead import CostMemo
from kvrelay.shared.worker.model_slot import ModelPlan, ModelSlot, RoleHooks
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.step_lock import HoldTimes, LockedPool, StepLock

log = logging.getLogger(__name__)

# one engine build at a time in the process: a build reads its resident overhead as the graph pools the caching
# allocator (the process's) gained over it (shared/engine/resident_memory.py), which another load's captures,
# interleaved with its own since neither holds the step lock throughout, would add to
_BUILDS = threading.Lock()


@dataclass
class Loading:
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


class ModelLoads:
    """ModelHost's load path: the attributes below are the host's (shared/worker/model_host.py), and so are
    the room-making methods it calls (shared/worker/load_room.py)."""

    base: EngineConfig
    hold_finished_kv: bool
    kv_links: KVLinks | None
    pool: KVPool | None
    weights_budget: int
    repo: ModelRepository | None
    configured_paths: dict[str, str]
    parallel_sizes: dict[str, tuple[int, int]]
    batch_queues: dict[str, bool]
    calculated_kv_scales: dict[str, bool]
    later_kv_scales: bool
    verify_checksums: bool
    freeze_gc: bool
    skip_warmup: bool
    shared: SharedWeights | None
    drain_timeout_s: float
    min_residency_s: float
    slots: dict[str, ModelSlot]
    loading: dict[str, Loading]
    failed: dict[str, tuple[str, str, int, float]]
    lock: StepLock
    hooks: RoleHooks | None
    _eos_ids: Callable[[EngineCore, str], list[int]]
    _report: Callable[[ControlResult], None]
    _demand: dict[str, DemandRate]
    _deferred: list[ControlCommand]
    costs: CostMemo
    make_room: Callable[..., list[str]]
    demand_of: Callable[[str, float], float]
    _sync_cap: Callable[[], bool]
    _answer: Callable[..., None]

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
        kv_dtype = cmd.kv_cache_dtype or self.base.cache.kv_cache_dtype
        # a model of the config file: its own choice; another: the flag's, where its KV is fp8
        scales = self.calculated_kv_scales.get(
            cmd.name, (self.base.cache.calculate_kv_scales or self.later_kv_scales) and kv_dtype != "auto")
        cache = dataclasses.replace(self.base.cache, kv_cache_dtype=kv_dtype, calculate_kv_scales=scales)
        tp, pp = self.parallel_sizes.get(cmd.name, (self.base.tensor_parallel_size, self.base.pipeline_parallel_size))
        # its cache first: the worker's calculated scales would be refused beside the model's own ranks
        engine = dataclasses.replace(self.base, model=model, cache=cache).with_parallel_sizes(
            tp, pp, self.batch_queues.get(cmd.name))
        check_device(cache.kv_cache_dtype, torch.device(engine.device))  # before any weight is read
        return self._sized(ModelPlan(name=cmd.name, version=cmd.version, path=path, engine=engine, pinned=cmd.pinned,
                                     keep_alive_s=cmd.keep_alive_s, verify=verify, root=root))

    def _sized(self, plan: ModelPlan) -> ModelPlan:
        """``plan`` with its weights estimated (a group checked first and counted as model_memory says), and
        what it will keep beside them and its step peak (model_overhead.py)."""
        plan.weight_bytes, plan.rank_weight_bytes = plan_weight_bytes(plan.engine, plan.root)
        plan.overhead_bytes, plan.step_peak_bytes = self.costs.costs(plan.engine, plan.root)
        return plan

    # -- loading --------------------------------------------------------------------------------
    def load_now(self, plan: ModelPlan) -> ModelSlot:
        """Synchronous load (models configured at startup); raises on failure."""
        if plan.engine.tensor_parallel_size * plan.engine.pipeline_parallel_size > 1 and not plan.rank_weight_bytes:
            plan = self._sized(plan)  # checked, and its shards sized for the budget and the status
        elif self.weights_budget and not plan.overhead_bytes:  # a step peak warm-up does not measure is estimated
            plan.overhead_bytes, plan.step_peak_bytes = self.costs.costs(plan.engine, plan.root)
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
        # weights are read here holding nothing, while the other models keep serving; the engine is built and
        # warmed up taking the step lock in pieces (HoldTimes: each hold timed, for the log): the pool attach,
        # each CUDA graph's capture, each warm-up shape, so the co-resident models step between pieces. Without
        # a shared pool on CUDA the build holds it throughout: the engine sizes its own KV from the allocator's
        # peak over a forward pass, which another model's step would add to. On CPU nothing is captured or
        # warmed up: only the pool attach takes the lock (LockedPool).
        tp, pp = plan.engine.tensor_parallel_size, plan.engine.pipeline_parallel_size
        if tp * pp > 1:  # each rank process loads its own shard (or stage): the engine starts them and loads
            loaded, how = None, (f"loaded as {tp} tensor-parallel shards" if pp == 1 else f"loaded as {pp} pipeline stages")
        elif self.shared is None:
            loaded, how = load_model(plan.engine.model, plan.engine.device, root=plan.root), "loaded"
        else:  # mapped from another worker process on this device, or loaded here and exported to them
            loaded, how = self.shared.load(plan.engine, plan.instance, plan.root)
        t_weights = time.perf_counter()
        cuda = plan.engine.device.startswith("cuda")
        holds = HoldTimes(self.lock)
        pool = LockedPool(self.pool, holds.hold("engine build")) if self.pool is not None else None
        with _BUILDS, holds.hold("engine build") if cuda and pool is None else contextlib.nullcontext():
            core = build_engine(lambda: EngineCore(plan.engine, hold_finished_kv=self.hold_finished_kv, kv_pool=pool,
                                                   kv_pool_key=plan.instance, loaded=loaded, model_root=plan.root,
                                                   kv_links=self.kv_links),
                                holds.hold("graph capture") if cuda else None)
        try:
            if not self.skip_warmup:  # before ready: the first requests must not pay for compiles
                warm_up_measured(core, decode=not self.hold_finished_kv, compiles=cuda,
                                 hold=holds.hold("warm-up") if cuda else None)
        except BaseException:
            core.abort_all()  # a shape's requests were in flight: else the release's refusal hides the failure
            core.release_kv()
            if self.shared is not None:
                self.shared.release(plan.instance)
            raise
        finally:
            holds.done()
        # a group counts every device it occupies (model_memory.group_weight_bytes), this process holds rank 0's
        # shard alone; the estimate is each rank's model built on the meta device, the same shapes it loaded
        weight_bytes = core.weight_bytes if tp * pp == 1 else plan.weight_bytes
        # measured; a step peak warm-up did not measure (skipped, the CPU) stays the plan's
        overhead, peak = core.resident_overhead_bytes, core.step_peak_bytes if core.memory.peak_measured else plan.step_peak_bytes
        self.costs.note(plan.engine, plan.root, overhead, peak)
        log.info("%s: weights %s in %.2fs, engine (KV attach, graphs%s) in %.2fs; held the step lock: %s", plan.instance,
                 how, t_weights - t0, "" if self.skip_warmup else ", warm-up", time.perf_counter() - t_weights,
                 holds.describe())
        return ModelSlot(instance=plan.instance, name=plan.name, version=plan.version, path=plan.path, core=core,
                         eos_ids=self._eos_ids(core, plan.path), pinned=plan.pinned,
                         keep_alive_s=plan.keep_alive_s, load_s=time.perf_counter() - t0,
                         weight_bytes=weight_bytes, rank_weight_bytes=plan.rank_weight_bytes,
                         overhead_bytes=overhead, step_peak_bytes=peak)

    def _ready(self, slot: ModelSlot) -> None:
        if self.freeze_gc:
            freeze_long_lived()  # the new model's objects live until its unload
        slot.demand = self._demand.pop(slot.instance, slot.demand)  # its demand before it left
        slot.loaded_at = time.monotonic()
        self.slots[slot.instance] = slot
        self.failed.pop(slot.instance, None)
        if self.hooks is not None:
            self.hooks.attach(slot)
        log.info("%s ready (%.2f GiB of weights, %.3f GiB kept beside them, step peak %.3f GiB; loaded in %.2fs)",
                 slot.instance, slot.weight_bytes / 2**30, slot.overhead_bytes / 2**30, slot.step_peak_bytes / 2**30,
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
        wait_s = room_wait_s((s.load_s for s in self.slots.values()), self.min_residency_s) if cmd.waiting > 0 else 0.0
        ld = Loading(plan, [cmd.command_id], time.perf_counter(), command=cmd, waiting=cmd.waiting,
                     wait_until=time.monotonic() + wait_s)
        self.loading[inst] = ld  # first: once room is made its weights count (weights_used, the KV cap)
        self._advance(ld)
        if ld.failed and ld.thread is None and not ld.after:  # no room, and none to wait for: refused now
            del self.loading[inst]
            self.failed[inst] = (ld.error, cmd.name, cmd.version, time.time())
            return self._answer(cmd, False, ld.error, time.perf_counter() - t0)

    def _advance(self, ld: Loading) -> None:
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

    def _load_thread(self, ld: Loading) -> None:
        gpu_share.enter()  # its graphs are captured and warmed up on the worker's compute stream
        try:
            with short_switches():  # the serving loop is not kept waiting for the GIL behind the load's Python
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
                release_memory()
            for cid in ld.command_ids:
                self._report(ControlResult(command_id=cid, worker_id="", instance=inst, ok=ld.slot is not None,
                                           error=ld.error, seconds=seconds, evicted=ld.evicted))
        if changed:
            self._sync_cap()  # the estimate made room; now its real weights count, or (failed) none
        return changed


def release_memory() -> None:
    collect_all()  # the unloaded model's objects may have been frozen with everything else
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
