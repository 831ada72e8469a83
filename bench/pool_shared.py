"""The pool mode of ``kvrelay bench pool`` (bench/pool_density.py), what a kvrelay worker does: as many models
resident as fit over one KV pool; a request for one that is not evicts a resident one as the worker chooses
(shared/worker/eviction.py) and loads its own on a side thread while the others keep stepping. Each cold load's
holds of the step lock are timed (shared/worker/step_lock.py HoldTimes) with its phases' wall times."""

import argparse
import threading
import time

import torch

from kvrelay.bench.pool_models import Models
from kvrelay.bench.pool_steps import Run
from kvrelay.bench.pool_workload import Arrival, percentile
from kvrelay.shared.engine import KVPool
from kvrelay.shared.engine.kv_pool import KVPoolFull
from kvrelay.shared.worker.eviction import Candidate, DemandRate, Incoming, choose_victims
from kvrelay.shared.worker.gil_switch import short_switches
from kvrelay.shared.worker.load_room import IDLE_GRACE_S
from kvrelay.shared.worker.step_lock import HoldTimes


class PoolRun(Run):
    def __init__(self, args: argparse.Namespace, models: Models, arrivals: list[Arrival], resident: list[int],
                 pool_bytes: int, device: torch.device):
        super().__init__(args, models, arrivals)
        self.slots = len(resident)
        self.pool = KVPool(pool_bytes, device)
        self.evictions = 0
        self.cold_loads: list[float] = []  # loads during the run: an evicted model coming back
        self.load_holds: list[HoldTimes] = []  # each cold load's holds of the step lock
        self.load_phases: list[dict[str, float]] = []  # each cold load's phases, wall seconds
        self._loading: tuple[int, threading.Thread, dict] | None = None  # model, its loading thread, result
        self.rates = {i: DemandRate() for i in range(args.num_models)}  # arrivals per second, decayed
        self.loaded_at: dict[int, float] = {}
        self.draining: set[int] = set()  # evicted while busy: no new request, freed once what runs finished
        for i in resident:
            self.cores[i] = models.load(i, pool=self.pool)
            self.loaded_at[i] = time.perf_counter()

    def loading(self) -> bool:
        return self._loading is not None

    def arrive(self, k: int) -> None:
        m = self.arrivals[k].model
        self.rates[m].note(time.perf_counter())
        if m in self.cores and m not in self.draining:
            self.submit(k)
        else:
            self.waiting.setdefault(m, []).append(k)

    def between_steps(self) -> None:
        if self._loading is not None:
            m, thread, result = self._loading
            if thread.is_alive():
                return
            self._loading = None
            if isinstance(result.get("error"), KVPoolFull):
                # the others' KV was in use; tried again next time round. The error's traceback holds the
                # frames of the load, and so its weights, in a cycle with ``result``: broken, and collected
                result.pop("error").__traceback__ = None
                self.models.memory.settle()
                return
            if "error" in result:
                raise result["error"]
            self.cores[m] = result.pop("core")  # the only reference: it may be evicted in this very call
            self.loaded_at[m] = time.perf_counter()
            self.cold_loads.append(result["seconds"])
            self.load_holds.append(result["holds"])
            self.load_phases.append(result["phases"])
            for k in self.waiting.pop(m):
                self.submit(k)
        for d in [d for d in self.draining if not self.cores[d].has_unfinished()]:
            self.draining.discard(d)
            self.models.free(self.cores.pop(d))  # what arrived while it drained waits for its reload
        waiting = sorted((m for m, ks in self.waiting.items() if ks and m not in self.cores),
                         key=lambda m: self.waiting[m][0])
        if not waiting or self.draining or (len(self.cores) >= self.slots and not self._evict_one(waiting[0])):
            return  # nothing to load, a victim still draining, or no resident model may go yet
        if len(self.cores) >= self.slots:
            return  # the victim drains first
        m, result = waiting[0], {}
        thread = threading.Thread(target=self._load, args=(m, result), daemon=True, name=f"load-{m}")
        self._loading = (m, thread, result)
        thread.start()

    def _load(self, m: int, result: dict) -> None:
        t0 = time.perf_counter()
        result["holds"], result["phases"] = HoldTimes(self.lock), {}  # timed on this thread, the load's
        try:
            with short_switches():  # as a worker's load thread runs (shared/worker/model_loads.py)
                result["core"] = self.models.load(m, pool=self.pool, holds=result["holds"], phases=result["phases"],
                                                  on_phase=lambda phase: setattr(self, "load_phase", phase))
        except Exception as exc:  # handed to the stepping thread, which raises it
            result["error"] = exc
        result["seconds"] = time.perf_counter() - t0

    def close(self, failed: bool = False) -> None:
        if self._loading is not None:  # a load in flight when the run failed: it ends, then goes too
            m, thread, result = self._loading
            self._loading = None
            thread.join()
            if "core" in result:
                self.cores[m] = result.pop("core")
        super().close(failed)
        self.pool = None  # its buffer too, before the static split's engines take the same memory
        self.models.memory.settle()

    def _evict_one(self, m: int) -> bool:
        """Room for ``m``'s load, as the worker chooses its victim (shared/worker/eviction.py): an idle one is
        freed now, a busy one starts draining. False: none may go (yet)."""
        now = time.perf_counter()
        reload_s = percentile(self.models.loads, 50) if self.models.loads else 1.0
        busy = {i: c.has_unfinished() for i, c in self.cores.items()}
        cands = candidates(now, reload_s, self.rates, busy, self.last_used, self.loaded_at, self.draining)
        ks = self.waiting[m]
        chosen = choose_victims(cands, 1, 0, incoming(now, m, self.rates, len(ks), self.outcomes[ks[0]].arrived))
        if not chosen:
            return False
        victim = int(chosen[0].instance)
        self.evictions += 1
        if chosen[0].idle:
            self.models.free(self.cores.pop(victim))
        else:
            self.draining.add(victim)
        return True


def candidates(now: float, reload_s: float, rates: dict[int, DemandRate], busy: dict[int, bool],
               last_used: dict[int, float], loaded_at: dict[int, float], draining: set[int]) -> list[Candidate]:
    """The resident models (``busy``: whether each has work) as the worker sees its slots (load_room.py): also
    what bench/eviction_sim.py hands the policy."""
    return [Candidate(instance=str(i), weight_bytes=1, kv_bytes=0, reload_s=reload_s, demand=rates[i].rate(now),
                      resident_s=now - loaded_at.get(i, now),
                      idle=not b and now - last_used.get(i, 0.0) > IDLE_GRACE_S,
                      idle_s=now - last_used.get(i, 0.0), ready=i not in draining)
            for i, b in busy.items()]


def incoming(now: float, m: int, rates: dict[int, DemandRate], waiting: int, oldest: float) -> Incoming:
    """``m``'s load, ``waiting`` requests for it since ``oldest``: every arrival is noted as it comes
    (``PoolRun.arrive``), so its rate holds them already."""
    return Incoming(rates[m].rate(now), waiting, now - oldest)
