"""Room for a load in a worker's weights budget and KV pool: what the weights use, what the pool may
commit (``_kv_cap``), and the victims a load evicts (shared/worker/eviction.py chooses them).

The budget (--weights-memory) holds each model's weights and what it keeps beside them while loaded (its
resident overhead: decode graphs, buffers), measured once it is loaded and estimated before
(shared/worker/model_overhead.py), plus ONE step peak, the largest of the hosted models': their steps run one
at a time under the step lock, so their activations never coexist.

The KV pool may commit its own size plus whatever of the weights budget no weights use: an unload raises
its cap (its models grow into the freed memory as they need it), and a load's room is made before its
weights are read: ``make_room`` counts the KV the pool could give back under the lower cap, and the build
starts only once the pool is within it (blocks in use are waited for, up to drain_timeout_s).
"""

import logging
import time
from collections.abc import Callable

from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.ranks.checks import group_size_name
from kvrelay.shared.worker.eviction import (
    Candidate,
    DemandRate,
    Incoming,
    choose_victims,
    waiting_demand,
)
from kvrelay.shared.worker.model_loads import Loading
from kvrelay.shared.worker.model_memory import kv_floor_bytes
from kvrelay.shared.worker.model_slot import ModelPlan, ModelSlot, RoleHooks
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.step_lock import StepLock

log = logging.getLogger(__name__)

IDLE_GRACE_S = 1.0  # an instance used this recently is never "idle", whatever its queues say


class LoadRoom:
    """ModelHost's memory accounting: the attributes below are the host's (shared/worker/model_host.py)."""

    pool: KVPool | None
    weights_budget: int
    min_residency_s: float
    shared: SharedWeights | None
    slots: dict[str, ModelSlot]
    loading: dict[str, Loading]
    lock: StepLock
    hooks: RoleHooks | None
    _demand: dict[str, DemandRate]

    unload_now: Callable[[str], None]

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

    @property
    def step_reserve(self) -> int:
        """The largest step peak of the models hosted or committed to load: held back once."""
        plans = [ld.plan for ld in self.loading.values() if ld.command is None]
        return max((x.step_peak_bytes for x in (*self.slots.values(), *plans)), default=0)

    @property
    def overhead_used(self) -> int:
        """The budget taken besides weights: each model's resident overhead, and the step reserve."""
        return (sum(s.overhead_bytes for s in self.slots.values())
                + sum(ld.plan.overhead_bytes for ld in self.loading.values() if ld.command is None)
                + self.step_reserve)

    @property
    def budget_used(self) -> int:
        return self.weights_used + self.overhead_used

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
        # its graphs and buffers are its own even where its weights are shared; its step peak only above the reserve
        beside = plan.overhead_bytes + max(0, plan.step_peak_bytes - self.step_reserve)
        free = self.weights_budget - self.budget_used
        need = weights + beside - free
        floor = self._floor_bytes(plan)
        # the KV pool gives back what it borrowed of the weights budget (kv_cap), keeping what is in use
        cap = self._kv_cap(weights + beside)
        # a group's KV stays within the pool's own size (its other ranks' caches mirror it: engine/kv_cache.py)
        within = plan.engine.tensor_parallel_size * plan.engine.pipeline_parallel_size > 1
        kv_short = 0 if self.pool is None else floor - self.pool.reclaimable_bytes(cap, within)
        if need <= 0 and kv_short <= 0:
            return []
        now = time.monotonic()
        ld = self.loading.get(plan.instance)  # registered before its room is made: since when its requests wait
        waited = time.perf_counter() - ld.started if ld is not None and waiting > 0 else 0.0
        load = Incoming(self.demand_of(plan.instance, now) + waiting_demand(waiting), waiting, waited)
        # a victim frees its weights and its overhead (its step peak too, if the largest: not counted on)
        candidates = [Candidate(instance=s.instance, weight_bytes=s.weight_bytes + s.overhead_bytes,
                                kv_bytes=self._owned_bytes(s),
                                reload_s=s.load_s, demand=s.demand.rate(now), resident_s=now - s.loaded_at,
                                idle=self._evictable(s), pinned=s.pinned, ready=s.state == "ready" and s.reading,
                                preferred=s.instance in prefer, idle_s=s.idle_s)
                      for s in self.slots.values()]
        chosen = choose_victims(candidates, need, kv_short, load, self.min_residency_s)
        if chosen is None or (chosen and not evict):
            gib = 2**30
            raise ValueError(
                f"not enough memory to load {plan.instance}: needs {plan.weight_bytes / gib:.2f} GiB of weights "
                + (f"({group_size_name(plan.engine)}: its {'largest shard' if plan.engine.device.startswith('cuda') else 'shards'}) "
                   if plan.rank_weight_bytes else "")
                + f"(free {free / gib:.2f} of {self.weights_budget / gib:.2f} GiB; it also needs {beside / gib:.2f} GiB "
                  f"beside its weights: graphs, buffers, its step peak above the {self.step_reserve / gib:.2f} GiB "
                  "held back)"
                + ("" if self.pool is None else f" and {floor / gib:.3f} GiB of KV (reclaimable "
                   f"{self.pool.reclaimable_bytes(cap, within) / gib:.3f} GiB)")
                + ("; no unpinned model in lower demand, nor the cheapest once it waited a minimum residency "
                   "(eviction.py), frees enough"
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
        """What the KV pool may commit: its own size plus the weights budget no model uses (nor ``loading``
        more bytes of it), so KV grows into what unloaded models free and gives it back to loads."""
        return self.pool.base_bytes + max(0, self.weights_budget - self.budget_used - loading)

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
