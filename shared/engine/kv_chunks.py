"""The KV pool's memory in chunks: an address range reserved once at the most the pool may ever span
(shared/engine/kv_memory.py: an mmap on CPU, the CUDA driver's virtual memory management on a GPU), of
which chunks are *committed* (backed by memory) only up to a cap, and which chunks a model owns.

Views, block ids and CUDA graph pointers cover the whole range and never change; only committed chunks can
be owned, so no model ever touches memory that is not backed. The chunks holding block 0 stay committed for
good (``keep``): padding rows of a batch read block 0 (shared/engine/step_inputs.py). Which model gets a
chunk is shared/engine/kv_pool.py's.
"""

import logging
import math
from collections.abc import Iterator

import torch

from kvrelay.shared.engine.kv_memory import reserve_kv_memory

log = logging.getLogger(__name__)

# A chunk is the unit of arbitration. Small chunks waste less at block-straddling boundaries and let a
# model give back memory in finer steps; large ones keep the bookkeeping (lists of chunk ids, a scan
# per steal) short. 64 MiB on a GPU is ~0.05% of an H200 (about 2k chunks) and holds 32 blocks of an
# 8B bf16 model (2 MiB per 16-token block); 2 MiB on CPU holds dozens of a small model's blocks. A
# small pool gets smaller chunks (at least MIN_CHUNKS of them), or there would be nothing to share. A
# block bigger than a chunk still works: it needs all the chunks it spans.
CUDA_CHUNK_BYTES = 64 << 20
CPU_CHUNK_BYTES = 2 << 20
MIN_CHUNKS = 64
PAGE = 4096  # chunk sizes stay page multiples


class KVChunks:
    def __init__(self, nbytes: int, device: torch.device | str, chunk_bytes: int | None = None,
                 max_bytes: int | None = None, fixed_because: str = ""):
        """Reserve the range for ``max_bytes`` (at least ``nbytes``) and back its first ``nbytes``."""
        self.device = torch.device(device)
        if chunk_bytes is None:
            default = CUDA_CHUNK_BYTES if self.device.type == "cuda" else CPU_CHUNK_BYTES
            chunk_bytes = min(default, max(PAGE, nbytes // MIN_CHUNKS // PAGE * PAGE))
        if nbytes < 1 or chunk_bytes < 1:
            raise ValueError(f"pool and chunk sizes must be positive, got {nbytes} and {chunk_bytes}")
        self.memory = reserve_kv_memory(nbytes, max(nbytes, max_bytes or nbytes), self.device, chunk_bytes,
                                        fixed_because)
        self.nbytes = self.memory.nbytes  # the reserved range every model views
        self.base_bytes = nbytes
        self.chunk_bytes = self.memory.chunk_bytes  # rounded up to what the memory can map
        self.num_chunks = math.ceil(self.nbytes / self.chunk_bytes)  # the last one may be short
        self.buffer = self.memory.tensor
        self.cap = min(nbytes, self.nbytes)  # committed bytes stay within it (but see set_cap)
        self.committed = [c * self.chunk_bytes < self.memory.committed_from_start for c in range(self.num_chunks)]
        self.committed_bytes = sum(self._chunk_size(c) for c in range(self.num_chunks) if self.committed[c])
        self.keep: set[int] = {c for c in range(self.num_chunks) if self.committed[c]} if self.memory.growable else set()
        self.owner: list[str | None] = [None] * self.num_chunks
        # committed and unowned: the first chunks a model gets (kept as a set: a growable pool has thousands
        # of chunks, and scanning them all on every grow cost a CPU worker ~3 ms a call)
        self.spare: set[int] = {c for c in range(self.num_chunks) if self.committed[c]}
        self._frontier = 0  # no chunk below it is uncommitted: new commits are looked for from here
        self._short = False  # the last commit failed: the device had no room
        if self.memory.growable:  # its own size is backed from the start, as a fixed buffer's was: only
            for c in range(self.cap // self.chunk_bytes):  # growth past it waits for demand
                self._commit(c)

    def _chunk_size(self, c: int) -> int:
        return min(self.chunk_bytes, self.nbytes - c * self.chunk_bytes)

    @property
    def free_bytes(self) -> int:
        """What a model could take without stealing: unowned committed chunks and the room left under the cap."""
        return self._spare_bytes() + max(0, self.cap - self.committed_bytes)

    @property
    def owned_bytes(self) -> int:
        return self.committed_bytes - self._spare_bytes()  # only committed chunks are ever owned

    def _spare_bytes(self) -> int:
        # list() copies the set in one step: the heartbeat thread reads this while the loop may change it
        return sum(map(self._chunk_size, list(self.spare)))

    def _own(self, c: int, key: str | None) -> None:
        self.owner[c] = key
        if key is None and self.committed[c]:
            self.spare.add(c)
        else:
            self.spare.discard(c)

    def _trim(self) -> None:
        """Decommit unowned chunks, highest first, while the pool is above its cap."""
        for c in sorted(self.spare - self.keep, reverse=True):
            if self.committed_bytes <= self.cap:
                return
            self._decommit(c)

    def _commit(self, c: int) -> bool:
        """Back chunk ``c``; False (logged) when the device has no room for it now."""
        if self.committed[c]:
            return True
        try:
            self.memory.commit(c * self.chunk_bytes, self._chunk_size(c))
        except MemoryError as exc:
            if not self._short:  # once until a commit succeeds again, not at every step's grow
                log.warning("KV pool could not commit %d MiB more (%s): growing stops here for now",
                            self._chunk_size(c) >> 20, exc)
            self._short = True
            return False
        self._short = False
        self.committed[c] = True
        self.committed_bytes += self._chunk_size(c)
        if self.owner[c] is None:
            self.spare.add(c)
        return True

    def _decommit(self, c: int) -> None:
        self.memory.decommit(c * self.chunk_bytes, self._chunk_size(c))
        self.committed[c] = False
        self.committed_bytes -= self._chunk_size(c)
        self.spare.discard(c)
        self._frontier = min(self._frontier, c)

    def _uncommitted(self, room: int, end: int) -> Iterator[int]:
        """Uncommitted chunks below ``end``, lowest first, as many as ``room`` bytes allow (the pool commits
        upwards, so they start at the frontier)."""
        while self._frontier < self.num_chunks and self.committed[self._frontier]:
            self._frontier += 1
        for c in range(self._frontier, end):
            if room < self._chunk_size(c):
                return
            if not self.committed[c]:
                room -= self._chunk_size(c)
                yield c
