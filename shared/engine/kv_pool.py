"""One KV memory pool shared by the models of one worker process, arbitrated by demand.

The pool is one byte buffer cut into fixed chunks. Every attached model views the *whole* buffer as
its own block array, block-major: block ``i`` of a model is bytes ``[i * block_bytes, (i + 1) *
block_bytes)``, all its layers and K/V together, and the view is permuted back to the
``[L, 2, N, bs, Hkv, D]`` shape the kernels index (they step blocks by ``stride(1)``). Models of
different geometry therefore number the same bytes differently; what keeps them apart is chunk
ownership: a model may use block ``i`` only while it owns every chunk that block touches (a block that
straddles into another model's chunk is simply unusable for it).

A model attaches with a floor (its guaranteed minimum of blocks). When its BlockManager runs out of
free blocks it calls ``grow``: the pool hands over unowned chunks first, then steals chunks from other
models, but only chunks whose blocks are all free in the victim (cached prefix blocks in them are
evicted from the victim's cache), and only while the victim keeps its floor. Victims with the most
free blocks and the least recent demand go first. So an idle co-resident model lends its memory to a
busy one, and gets it back the moment it needs it and the busy one has any free chunk.

The pool's size follows the memory its worker has free (``set_cap``); its chunks, which are committed and
which owned, are shared/engine/kv_chunks.py's. Chunks are committed only up to a cap: its own size at the
start, committed at once as a fixed buffer would be, then whatever the worker allows. ``grow`` takes unowned
committed chunks first, then commits new ones while the cap allows, then steals. The worker raises the cap
when a model's weights leave and lowers it before a load: ``set_cap`` then decommits unowned chunks and takes
free chunks back from models above their floors (the same rule a steal follows). A pool made without room to
grow (``max_bytes``), or where growable memory is unavailable, is one fixed buffer as before and refuses a
higher cap with its reason logged once. A model may attach with a view of the pool's own size only
(``within_base``: a parallel group, whose other ranks hold caches of its view's length): it gets no chunk
past that size, so its block ids stay below it however far the pool grows.

Everything here runs on the worker's one engine thread, synchronously. That is also what makes a
steal safe on CUDA: each engine's step (schedule, then its kernels on the same stream) is issued
before the next engine's, so the grower's writes queue behind the victim's last reads.
"""

import logging
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvrelay.shared.engine.kv_chunks import KVChunks

log = logging.getLogger(__name__)


class KVPoolFull(ValueError):
    pass


class PoolClient(Protocol):
    """What the pool needs from a model's block manager to take blocks back (shared/engine/block_manager.py)."""

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_free(self, ids: list[int]) -> bool:
        """Whether every owned block among ``ids`` has ref count 0 (ids it does not own are ignored)."""

    def release_free_blocks(self, ids: list[int]) -> bool:
        """Give up these owned blocks, all or none; only ref-0 ones, evicting their cache entries."""


@dataclass
class Member:
    key: str
    block_bytes: int
    num_blocks: int  # N: the length of this model's view of the buffer
    floor_blocks: int
    end_chunk: int  # the chunks its view touches are those below it: no others can give it a block
    chunks: set[int] = field(default_factory=set)
    blocks: set[int] = field(default_factory=set)  # usable: every chunk they touch is owned
    client: PoolClient | None = None
    last_demand: int = 0  # pool tick of its latest attach/grow; older = idler = stolen from first


class KVPool(KVChunks):
    def __init__(self, nbytes: int, device: torch.device | str, chunk_bytes: int | None = None,
                 max_bytes: int | None = None, fixed_because: str = ""):
        """``nbytes``: the pool's size to start with (its cap); ``max_bytes``: the most ``set_cap`` may raise
        it to, reserved now and backed only as chunks are committed (default ``nbytes``: a fixed buffer).
        ``fixed_because``: keep it fixed anyway, for this reason (logged when it is asked to grow)."""
        self.members: dict[str, Member] = {}
        self._tick = 0
        self._said_fixed = False
        super().__init__(nbytes, device, chunk_bytes, max_bytes, fixed_because)

    # -- geometry ---------------------------------------------------------------------------------
    def _chunks_of(self, m: Member, block: int) -> range:
        start = block * m.block_bytes
        return range(start // self.chunk_bytes, (start + m.block_bytes - 1) // self.chunk_bytes + 1)

    def _blocks_in(self, m: Member, chunk: int) -> range:
        """The blocks of ``m`` that touch ``chunk``."""
        start = chunk * self.chunk_bytes
        end = start + self._chunk_size(chunk)
        return range(start // m.block_bytes, min(m.num_blocks, (end - 1) // m.block_bytes + 1))

    # -- attach / detach --------------------------------------------------------------------------
    def attach(self, key: str, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, floor_blocks: int, within_base: bool = False) -> tuple[torch.Tensor, list[int]]:
        """This model's ``[L, 2, N, bs, Hkv, D]`` view of the whole pool and the block ids it may use
        now (at least ``floor_blocks``). Raises KVPoolFull when even reclaiming cannot cover the floor.
        ``within_base``: the view covers only the pool's own size (``base_bytes``), never the range reserved
        for growth, so the model's block ids stay below ``base_bytes // block_bytes`` however far the pool
        grows (a parallel group, whose other ranks hold a cache of its view's length: kv_cache.py)."""
        if key in self.members:
            raise ValueError(f"{key!r} is already attached to this KV pool")
        if floor_blocks < 1:
            raise ValueError(f"floor_blocks must be at least 1, got {floor_blocks}")
        block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
        num_blocks = min(self.nbytes, self.base_bytes if within_base else self.nbytes) // block_bytes
        m = Member(key, block_bytes, num_blocks, floor_blocks, math.ceil(num_blocks * block_bytes / self.chunk_bytes))
        if min(m.num_blocks, self.cap // block_bytes) < floor_blocks:
            raise KVPoolFull(f"{key}: a floor of {floor_blocks} KV blocks needs {floor_blocks * block_bytes} bytes, "
                             f"the whole pool is {self.cap}")
        if self.memory.growable:  # padding rows read block 0 (step_inputs.py): its chunks stay backed
            for c in self._chunks_of(m, 0):
                if not self._commit(c):
                    raise KVPoolFull(f"{key}: no device memory left to back its block 0")
                self.keep.add(c)
        plan = self._plan(m, floor_blocks, dry_run=True)
        if plan is None:
            raise KVPoolFull(
                f"{key}: a floor of {floor_blocks} KV blocks ({block_bytes} bytes each) needs at least "
                f"{floor_blocks * block_bytes} bytes, but only {self.reclaimable_bytes()} of the pool's "
                f"{self.cap} bytes are unowned or reclaimable from other models above their floors")
        self.members[key] = m
        self._take(m, self._plan(m, floor_blocks, dry_run=False) or [])
        kv = self.buffer[:m.num_blocks * block_bytes].view(dtype)
        kv = kv.view(m.num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim).permute(1, 2, 0, 3, 4, 5)
        return kv, sorted(m.blocks)  # kv: [L, 2, N, bs, Hkv, D]

    def bind(self, key: str, client: PoolClient) -> None:
        """Register the block manager the pool takes ``key``'s blocks back through. Until then none are."""
        self.members[key].client = client

    def detach(self, key: str) -> None:
        """Return all of ``key``'s chunks (decommitted where the pool is above its cap). The caller has
        stopped using its blocks."""
        m = self.members.pop(key)
        for c in m.chunks:
            self._own(c, None)
        self._trim()

    # -- the cap ----------------------------------------------------------------------------------
    def set_cap(self, cap: int) -> bool:
        """Let the pool commit up to ``cap`` bytes. Raising it commits nothing now (``grow`` commits chunks
        as models need them). Lowering it gives memory back at once: unowned chunks are decommitted, then
        free chunks are taken from models above their floors (idlest first, as a steal) and decommitted.
        True when the committed bytes are within ``cap``; False while blocks in use keep them above it (the
        cap holds, no chunk is committed until they are, and calling again takes what became free).
        A fixed pool keeps its size and logs why once."""
        if not self.memory.growable:
            if cap > self.nbytes and not self._said_fixed:
                self._said_fixed = True
                log.warning("KV pool stays at %d MiB, not the %d MiB its worker has room for: %s",
                            self.nbytes >> 20, cap >> 20, self.memory.why_fixed)
            return True
        self.cap = min(max(cap, 0), self.nbytes)
        if self.committed_bytes <= self.cap:
            return True
        self._trim()
        others = sorted((v for v in self.members.values() if v.client is not None),
                        key=lambda v: (-v.client.num_free_blocks, v.last_demand))
        for v in others:
            kept = set(v.blocks)
            for c in sorted(v.chunks - self.keep, reverse=True):
                if self.committed_bytes <= self.cap:
                    return True
                lost = self._stealable(v, kept, c)
                if lost is not None:
                    self._release(v, c, lost)
                    self._decommit(c)
        return self.committed_bytes <= self.cap

    # -- growth -----------------------------------------------------------------------------------
    def grow(self, key: str, n_blocks: int) -> list[int]:
        """Up to (and, as chunks come whole, possibly more than) ``n_blocks`` new usable block ids for
        ``key``, fewer or none when the pool is out. The caller adds them to its block manager."""
        m = self.members[key]
        self._tick += 1
        m.last_demand = self._tick
        if n_blocks < 1:
            return []
        return sorted(self._take(m, self._plan(m, len(m.blocks) + n_blocks, dry_run=False) or []))

    def _plan(self, m: Member, want: int, dry_run: bool) -> list[int] | None:
        """Chunks that bring ``m`` to ``want`` usable blocks: unowned ones, then ones stolen from others.

        Dry run: nothing changes, and None means ``want`` is out of reach. Otherwise the steals happen
        (victims release their blocks) and the chunks gathered so far come back even if short."""
        have = set(m.chunks)
        usable = len(m.blocks)
        got: list[int] = []
        for c in self._candidates(m, list(self.spare)):
            if usable >= want:
                break
            got.append(c)
            usable += self._gain(m, have, c)
        for c in self._uncommitted(self.cap - self.committed_bytes, m.end_chunk):
            if usable >= want:
                break
            got.append(c)
            usable += self._gain(m, have, c)
        others = sorted((v for v in self.members.values() if v is not m and v.client is not None),
                        key=lambda v: (-v.client.num_free_blocks, v.last_demand))
        for v in others:
            if usable >= want:
                break
            kept = set(v.blocks)
            for c in self._candidates(m, sorted(v.chunks, reverse=True)):
                if usable >= want:
                    break
                lost = self._stealable(v, kept, c)
                if lost is None:
                    continue
                if not dry_run:
                    self._release(v, c, lost)
                got.append(c)
                usable += self._gain(m, have, c)
        if dry_run:
            return got if usable >= want else None
        return got

    def _complete_in(self, m: Member, have: set[int], c: int) -> list[int] | range:
        """``m``'s blocks touching chunk ``c`` whose every chunk is in ``have``. Only the first and the last
        can reach past ``c``: the ones between lie inside it, so they need no check (a pool holds up to
        ~100k small blocks, and checking each one cost a CPU worker ~0.6 s at start)."""
        blocks = self._blocks_in(m, c)
        edges = blocks if len(blocks) <= 2 else (blocks[0], blocks[-1])
        return [*(b for b in edges if all(x in have for x in self._chunks_of(m, b))), *blocks[1:-1]]

    def _gain(self, m: Member, have: set[int], c: int) -> int:
        """Add chunk ``c`` to ``have``; the number of ``m``'s blocks that become usable by it."""
        have.add(c)
        return len(self._complete_in(m, have, c))

    def _candidates(self, m: Member, chunks: list[int]) -> list[int]:
        """The ``chunks`` within ``m``'s view (one past it would be committed, or stolen from another model,
        for no block of ``m``), those next to ``m``'s own first: they complete blocks straddling its edge."""
        return sorted((c for c in chunks if c < m.end_chunk),
                      key=lambda c: (c - 1 not in m.chunks and c + 1 not in m.chunks))

    def _stealable(self, v: Member, kept: set[int], c: int) -> list[int] | None:
        """The blocks ``v`` loses with chunk ``c`` (dropped from ``kept``), or None if it cannot give
        ``c`` up now: some block there is in use, or the blocks left would fall below its floor."""
        lost = [b for b in self._blocks_in(v, c) if b in kept]
        if len(kept) - len(lost) < v.floor_blocks or not v.client.blocks_free(lost):
            return None
        kept.difference_update(lost)
        return lost

    def _release(self, v: Member, c: int, lost: list[int]) -> None:
        if lost and not v.client.release_free_blocks(lost):
            raise RuntimeError(f"{v.key} refused to release blocks it reported free")  # a client bug
        v.blocks.difference_update(lost)
        v.chunks.discard(c)
        self._own(c, None)

    def _take(self, m: Member, chunks: list[int]) -> set[int]:
        """Give ``m`` these chunks (committing them first); the blocks that became usable."""
        for i, c in enumerate(chunks):
            if not self._commit(c):
                chunks = chunks[:i]  # the device is full: what was had so far
                break
        for c in chunks:
            self._own(c, m.key)
            m.chunks.add(c)
        new: set[int] = set()
        for c in chunks:
            new.update(b for b in self._complete_in(m, m.chunks, c) if b not in m.blocks)
        m.blocks.update(new)
        # chunks that complete no block (a straddling block whose other chunk could not be had) go back
        for c in [c for c in chunks if not any(b in m.blocks for b in self._blocks_in(m, c))]:
            m.chunks.discard(c)
            self._own(c, None)
        return new

    # -- introspection ----------------------------------------------------------------------------
    def reclaimable_bytes(self, cap: int | None = None, within_base: bool = False) -> int:
        """What a model attaching now could own under ``cap`` (default: the pool's; a lower one is what a
        load's weights would leave): the cap less every owned chunk, except those other models could give
        up now (all free, above their floors), each victim taken chunk by chunk from its high end, as grow
        would. ``within_base``: for an attach whose view is the pool's own size (``attach``), which neither
        memory past that size nor another model's chunks there can give a block: at most that size less what
        is owned in it, except what could be stolen in it."""
        cap = self.cap if cap is None or not self.memory.growable else min(cap, self.nbytes)
        total = cap - self.owned_bytes
        end = math.ceil(self.base_bytes / self.chunk_bytes)
        inside = min(cap, self.base_bytes) - sum(self._chunk_size(c) for c in range(end) if self.owner[c] is not None)
        for v in self.members.values():
            if v.client is not None:
                kept = set(v.blocks)
                for c in sorted(v.chunks, reverse=True):
                    if (not within_base or c < end) and self._stealable(v, kept, c) is not None:
                        total += self._chunk_size(c)
                        inside += self._chunk_size(c) if c < end else 0
        return max(0, min(total, inside) if within_base else total)

    def capacity(self, key: str) -> int:
        """The most blocks ``key`` could own if every other model shrank to its floor (a slight over-
        estimate where blocks straddle chunks): requests needing more can never run."""
        m = self.members[key]
        reserved = sum(math.ceil(v.floor_blocks * v.block_bytes / self.chunk_bytes) * self.chunk_bytes
                       for v in self.members.values() if v is not m)
        return max(0, min(m.num_blocks, (self.cap - reserved) // m.block_bytes))

    def stats(self) -> dict[str, dict[str, int]]:
        """Per model: owned (usable) blocks, floor, free blocks, owned bytes: for heartbeats and metrics."""
        return {
            k: {"owned_blocks": len(m.blocks), "floor_blocks": m.floor_blocks,
                "free_blocks": m.client.num_free_blocks if m.client is not None else len(m.blocks),
                "owned_bytes": sum(self._chunk_size(c) for c in m.chunks), "block_bytes": m.block_bytes}
            for k, m in self.members.items()
        }

