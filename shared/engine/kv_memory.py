"""The memory behind a KV pool (shared/engine/kv_pool.py): one address range reserved once at the most
the pool may ever span, backed chunk by chunk only while the pool commits it.

The pool's models view the whole range as their block arrays, so the range's address must never move
(block ids, the views and CUDA graphs' captured pointers all hold it). Growing a pool therefore cannot
mean a new, bigger buffer; it means backing more of a range that was reserved big from the start:

* ``HostMemory`` (CPU): an anonymous private ``mmap`` with MAP_NORESERVE. Untouched pages cost nothing;
  a committed chunk's pages are backed as they are first written, and ``decommit`` is
  ``madvise(MADV_DONTNEED)``, which gives them back to the kernel at once (RSS drops) and makes them read
  as zeros again.
* ``CudaMemory`` (shared/engine/cuda_vmm.py): the driver's virtual memory management: one
  ``cuMemAddressReserve`` for the range, a ``cuMemCreate`` + ``cuMemMap`` per committed chunk.
* ``FixedMemory``: one ordinary allocation of the starting size, every byte backed, never grown. For a
  pool that is not meant to grow, and the fallback where the others are unavailable: ``why_fixed``
  says why, and the pool logs it when asked to grow.
"""

import logging
import mmap
import sys
from typing import Protocol

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# Linux's flag value on x86-64 and arm64; the mmap module does not export it
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class KVMemory(Protocol):
    tensor: torch.Tensor  # uint8, the whole reserved range; only committed chunks may be touched
    nbytes: int  # the reserved range
    chunk_bytes: int  # the commit unit: the pool's chunk, rounded to what the backing can map
    growable: bool
    why_fixed: str  # empty when growable
    committed_from_start: int  # bytes from offset 0 already backed when it is made

    def commit(self, offset: int, size: int) -> None:
        """Back ``[offset, offset + size)``; MemoryError when the device has no room for it."""

    def decommit(self, offset: int, size: int) -> None:
        """Give ``[offset, offset + size)`` back to the OS or the driver; nothing may touch it until committed again."""


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class FixedMemory:
    growable = False

    def __init__(self, nbytes: int, device: torch.device, chunk_bytes: int, why_fixed: str):
        if device.type == "cpu":
            # an anonymous mapping reads as zeros and takes memory only where blocks are written; torch.zeros
            # writes every byte, so each engine held its whole KV resident from the start (a test process
            # with a few engines alive took gigabytes)
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        else:
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.nbytes, self.chunk_bytes, self.why_fixed = nbytes, chunk_bytes, why_fixed
        self.committed_from_start = nbytes

    def commit(self, offset: int, size: int) -> None:
        pass  # all of it is backed from the start

    def decommit(self, offset: int, size: int) -> None:
        pass  # never: a fixed pool's cap never falls below its size


class HostMemory:
    growable = True
    why_fixed = ""
    committed_from_start = 0

    def __init__(self, nbytes: int, chunk_bytes: int):
        self.chunk_bytes = _round_up(chunk_bytes, PAGE)  # madvise works on whole pages
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def commit(self, offset: int, size: int) -> None:
        pass  # the kernel backs each page on its first write; reading an untouched one costs nothing

    def decommit(self, offset: int, size: int) -> None:
        self._map.madvise(mmap.MADV_DONTNEED, offset, _round_up(size, PAGE))


def reserve_kv_memory(nbytes: int, max_bytes: int, device: torch.device, chunk_bytes: int,
                      fixed_because: str = "") -> KVMemory:
    """Memory for a pool of ``nbytes`` that may grow to ``max_bytes``: growable where it can be, else a
    fixed ``nbytes`` buffer that says why (logged here when growable memory was wanted but failed)."""
    if fixed_because or max_bytes <= nbytes:
        return FixedMemory(nbytes, device, chunk_bytes,
                           fixed_because or "the pool was sized once (no room to grow into was given)")
    why = ""
    if device.type == "cpu":
        if sys.platform.startswith("linux"):
            try:
                return HostMemory(max_bytes, chunk_bytes)
            except (OSError, ValueError) as exc:  # e.g. strict overcommit (vm.overcommit_memory=2)
                why = f"reserving {max_bytes} bytes of address space failed: {exc}"
        else:
            why = "growing needs Linux's mmap(MAP_NORESERVE) and madvise(MADV_DONTNEED)"
    elif device.type == "cuda":
        from kvrelay.shared.engine.cuda_vmm import CudaMemory, VMMUnavailable

        try:
            return CudaMemory(max_bytes, device, chunk_bytes)
        except (VMMUnavailable, RuntimeError) as exc:  # no driver support, or a driver call refused
            why = f"CUDA virtual memory management unavailable: {exc}"
    else:
        why = f"no growable KV memory on {device.type}"
    log.warning("KV pool fixed at %d MiB (it will not grow into memory unloaded models free): %s",
                nbytes >> 20, why)
    return FixedMemory(nbytes, device, chunk_bytes, why)
