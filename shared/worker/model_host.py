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

Loading is shared/worker/model_loads.py, the room a load makes shared/worker/load_room.py, and the
heartbeat's view of the instances shared/worker/model_status.py.

Threads: the control listener only moves commands into ``commands``; loads run on their own thread and
touch the pool only under ``lock``, which the worker's loop holds around each step, so the engine's
tensors and the pool's bookkeeping are only ever changed by one thread at a time.
"""

import logging
import queue
import time
from collections.abc import Callable

from kvrelay.shared.config.common import DRAIN_TIMEOUT_S
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.config.worker import MIN_RESIDENCY_S
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult, InstanceStatus
from kvrelay.shared.worker.eviction import DemandRate
from kvrelay.shared.worker.load_room import LoadRoom
from kvrelay.shared.worker.model_loads import Loading, ModelLoads, release_memory
from kvrelay.shared.worker.model_overhead import CostMemo
from kvrelay.shared.worker.model_slot import ModelSlot, RoleHooks
from kvrelay.shared.worker.model_status import instance_statuses
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.step_lock import StepLock

log = logging.getLogger(__name__)

FAILED_KEEP_S = 300.0
KEEP_ALIVE_CHECK_S = 1.0


class ModelHost(ModelLoads, LoadRoom):
    def __init__(self, base: EngineConfig, *, hold_finished_kv: bool, pool: KVPool | None,
                 weights_budget: int, repo: ModelRepository | None = None,
                 configured_paths: dict[str, str] | None = None, verify_checksums: bool = True,
                 eos_ids: Callable[[EngineCore, str], list[int]] | None = None,
                 report: Callable[[ControlResult], None] | None = None,
                 min_replicas: Callable[[str], int] | None = None, freeze_gc: bool = False,
                 skip_warmup: bool = False, shared: SharedWeights | None = None,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, parallel_sizes: dict[str, tuple[int, int]] | None = None,
                 kv_links: KVLinks | None = None, min_residency_s: float = MIN_RESIDENCY_S,
                 batch_queues: dict[str, bool] | None = None, calculated_kv_scales: dict[str, bool] | None = None,
                 later_kv_scales: bool = False):
        """``eos_ids(core, path)`` gives an instance's stop ids; ``report(ControlResult)`` answers a command;
        ``min_replicas(name)`` reads the registry (keep-alive never unloads a model kept at a minimum).
        ``freeze_gc``: this process is a worker, so loaded models may leave the garbage collector's view
        (shared/worker/gc_freeze.py); never in a process that is not ours alone. Each instance runs its
        warm-up (shared/engine/warmup.py) before it is ready, unless ``skip_warmup``. ``shared``: weights are
        shared with the other worker processes on this device (shared/worker/shared_weights.py).
        ``drain_timeout_s``: what a busy model evicted for a load gives its running requests to finish, as a
        SIGTERM drain gives a worker's (--drain-timeout). ``parallel_sizes``: name -> (tensor_parallel_size,
        pipeline_parallel_size) of the models the config file gives their own; the others take ``base``'s.
        ``batch_queues``: name -> whether that model of the config file keeps the pipeline batch queue;
        ``calculated_kv_scales``: whether it calculates its fp8 KV scales (--calculate-kv-scales);
        ``later_kv_scales``: whether the other models whose KV is fp8 do, as ``base``'s own cache says otherwise.
        ``kv_links``: the ranks of a model split over processes send their own parts of its KV to decode
        workers with these (the worker's CURVE keys). ``min_residency_s``: how long a model just loaded keeps
        its place against a load not far above its demand (--min-residency-s, shared/worker/eviction.py)."""
        self.min_residency_s = min_residency_s
        self.drain_timeout_s = drain_timeout_s
        self.kv_links = kv_links
        self.base = base
        self.hold_finished_kv = hold_finished_kv
        self.pool = pool
        self.weights_budget = weights_budget
        self.repo = repo
        self.configured_paths = dict(configured_paths or {})  # name -> path the operator configured
        self.parallel_sizes = dict(parallel_sizes or {})
        self.batch_queues = dict(batch_queues or {})
        self.calculated_kv_scales = dict(calculated_kv_scales or {})
        self.later_kv_scales = later_kv_scales
        self.verify_checksums = verify_checksums
        self.freeze_gc = freeze_gc
        self.skip_warmup = skip_warmup
        self.shared = shared
        self._checked_shared = 0.0
        self._eos_ids = eos_ids or (lambda core, path: [])
        self._report = report or (lambda result: None)
        self._min_replicas = min_replicas or (lambda name: 0)
        self.slots: dict[str, ModelSlot] = {}
        self.loading: dict[str, Loading] = {}
        self.failed: dict[str, tuple[str, str, int, float]] = {}  # instance -> (error, name, version, when)
        self.commands: queue.Queue[ControlCommand] = queue.Queue()
        self.lock = StepLock()
        self.hooks: RoleHooks | None = None
        self._checked_keep_alive = 0.0
        self._demand: dict[str, DemandRate] = {}  # instance -> its rate while it was here (a reload's demand)
        self._deferred: list[ControlCommand] = []  # loads of an instance still draining out for an eviction
        self.costs = CostMemo()  # each model shape's measured overhead and step peak, for the next load's plan

    # -- unloading ------------------------------------------------------------------------------
    def unload_now(self, instance: str) -> None:
        slot = self.slots.pop(instance)
        self._demand[instance] = slot.demand  # its next load's demand (eviction.py)
        if self.hooks is not None:
            self.hooks.detach(slot)
        slot.core.release_kv()
        slot.core = None  # drop the last reference before collecting
        release_memory()
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
        return instance_statuses(self.pool, self.slots, self.loading, self.failed)
