"""The tensor-parallel group one model shard belongs to, handed to every layer that shards or reduces.

A ``ParallelState`` of size 1 (``SINGLE``) makes every collective a no-op, so the models run the same
code with and without tensor parallelism. The group is a torch.distributed process group built directly
(gloo on CPU, NCCL on CUDA) from a store in the group's private folder, not the process-wide default
group: one process may hold several models, each with its own group, and a group can be torn down and
rebuilt (a new ``LLM``) without touching global state.
"""

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# A collective waits at most this long for a peer. Ranks run in lockstep, so a wait this long means a
# peer is gone or wedged; rank 0 also watches its ranks' processes (ranks.py) and fails sooner on a death.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None when world_size == 1
    device: torch.device = torch.device("cpu")  # where the group's tensors live (this rank's device)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the process that schedules, samples and holds the full logits."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (the output of a row-parallel projection)."""
        if self.group is not None:
            self.group.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` concatenated along the last dimension, in rank order."""
        if self.group is None:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape on all) on rank 0, in rank order; None on the other ranks."""
        if self.group is None:
            return [t]
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.is_driver else []
        self.group.gather([parts] if self.is_driver else [], [t], opts).wait()
        return parts if self.is_driver else None

    def scatter_from_driver(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank r receives rank 0's ``parts[r]`` into ``out`` (``parts``: rank 0's, None elsewhere)."""
        if self.group is None:
            return out.copy_(parts[0])
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        inputs = [[p.contiguous() for p in parts]] if self.is_driver else []
        self.group.scatter([out], inputs, opts).wait()
        return out

    def broadcast_from_driver(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype on all), in place."""
        if self.group is None:
            return t
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()
        return t

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank holds (KV blocks that fit on every rank)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())


SINGLE = ParallelState()


def connect(rank: int, world_size: int, folder: Path, device: torch.device,
            timeout_s: float = COLLECTIVE_TIMEOUT_S, name: str = "rendezvous") -> ParallelState:
    """Join the group whose rendezvous file ``name`` lives in ``folder`` (private to the group). Every rank
    calls this; it returns once all ``world_size`` have joined (or raises after ``timeout_s``). A pipeline of
    tensor-parallel stages joins the whole group, then its stage's group under its own ``name``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.FileStore(str(folder / name), world_size)
    store.set_timeout(timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # every rank runs on this host: loopback, whatever the host name resolves to
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(store, rank, world_size, opts)
    state = ParallelState(rank, world_size, group, device)
    state.all_reduce(torch.zeros(1, device=device))  # every rank connected before anyone proceeds
    return state
