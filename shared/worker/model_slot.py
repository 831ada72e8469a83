"""What a worker hosts, as the host and the roles both see it: a loaded instance (``ModelSlot``), the plan
that builds one (``ModelPlan``), and what a role tells the host about an instance (``RoleHooks``). The
host's lifecycle (loading, eviction, keep-alive) is shared/worker/model_host.py."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.wire.protocol import RankStatus, instance_key
from kvrelay.shared.worker.eviction import DemandRate
from kvrelay.shared.worker.metrics import WorkerMetrics


class RoleHooks(Protocol):
    """What a worker role tells the host about one instance."""

    def attach(self, slot: "ModelSlot") -> None:
        """The instance is ready: start serving it (queues, sockets, per-instance state)."""

    def detach(self, slot: "ModelSlot") -> None:
        """The instance is about to be unloaded; nothing is in flight for it any more."""

    def idle(self, slot: "ModelSlot") -> bool:
        """Nothing queued for it, nothing in flight here: unloading it loses no request."""

    def may_unload(self, slot: "ModelSlot") -> bool:
        """A draining instance finished everything it must (its peers included)."""

    def busy(self, slot: "ModelSlot") -> bool:
        """Requests in flight here for it (its jobs still queued in Redis aside): an instance evicted while
        busy is unloaded once this is False."""


@dataclass
class ModelSlot:
    instance: str
    name: str
    version: int
    path: str  # model directory (tokenizer files too)
    core: EngineCore
    eos_ids: list[int]
    pinned: bool = False
    keep_alive_s: float = 0.0
    load_s: float = 0.0
    weight_bytes: int = 0  # what it counts against the weights budget (a group: model_memory.group_weight_bytes)
    rank_weight_bytes: list[int] = field(default_factory=list)  # a group's shard on each rank, rank order
    overhead_bytes: int = 0  # kept besides weights and KV while loaded (shared/engine/resident_memory.py)
    step_peak_bytes: int = 0  # its largest step's temporaries: the worker holds the largest of these back once
    state: str = "ready"  # ready | draining
    last_used: float = field(default_factory=time.monotonic)
    metrics: WorkerMetrics | None = None  # set once the worker serves it
    demand: DemandRate = field(default_factory=DemandRate)  # its requests' arrival rate (eviction.py)
    loaded_at: float = field(default_factory=time.monotonic)
    reading: bool = True  # False: evicted while busy; its stream is not read while what runs finishes

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def note_request(self) -> None:
        """A request for it arrived here (a job read or a handoff taken)."""
        self.last_used = time.monotonic()
        self.demand.note(self.last_used)

    @property
    def idle_s(self) -> float:
        return time.monotonic() - self.last_used


@dataclass
class ModelPlan:
    """Everything needed to build one instance, resolved and checked before any memory is touched."""

    name: str
    version: int
    path: str
    engine: EngineConfig
    pinned: bool = False
    keep_alive_s: float = 0.0
    weight_bytes: int = 0  # the estimate
    overhead_bytes: int = 0  # estimated, or measured on a model of the same shape (shared/worker/model_overhead.py)
    step_peak_bytes: int = 0
    rank_weight_bytes: list[int] = field(default_factory=list)  # a tensor- or pipeline-parallel group's, per rank
    verify: Callable[[], None] | None = None  # raises RepositoryError on a corrupt copy; runs on the loading thread
    root: Path | None = None  # a repository version's: every file it opens must resolve inside

    @property
    def instance(self) -> str:
        return instance_key(self.name, self.version)


def group_status(engine: EngineConfig, processes: list[tuple[int, int, str]], rank_bytes: list[int]) -> dict:
    """An instance's parallel layout as its status reports it: the sizes, and each rank's process (none
    while it loads), device and shard."""
    ranks = [RankStatus(rank=rank, pid=pid, device=device, weight_bytes=rank_bytes[rank] if rank < len(rank_bytes) else 0)
             for rank, pid, device in processes]
    return {"tensor_parallel_size": engine.tensor_parallel_size,
            "pipeline_parallel_size": engine.pipeline_parallel_size, "ranks": ranks}
