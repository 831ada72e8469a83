"""The handoff of a worker whose KV is split over ranks (``EngineKV.sharded``): its heads over tensor-
parallel ranks, its layers over pipeline stages, or both.

The header always states the model's whole layout (``num_layers``, ``num_kv_heads``, in checkpoint order),
so prefill and decode workers of any parallel layouts meet in the middle and a peer of another model's
shape is refused by ``check_layout``. A sharded sender's ranks each send their own part of the prompt's
blocks straight to the decode worker (rank_parts.py, shared/engine/ranks/kv_parts.py); rank 0 keeps the
grant, the header and the ack. One without links for its ranks (``EngineKV.sends_by_rank`` false: the
offline API, some tests) still gathers a full copy to rank 0 (``exported``) and sends it as ordinary
frames. A sharded receiver whose ranks each listen on a socket of their own names them in the grant
(``EngineKV.part_targets``): a sharded sender's ranks then send each decode rank its own layers and heads (a
one-rank sender with links splits its whole KV among them the same way, ``EngineKV.sends_parts_to``), rank 0
takes its share into its own cache and lands the transfer once every other rank reported its share in
(``ByRankReceiver``; shared/engine/ranks/kv_inlet.py). KV sent whole (frames of a sender without links, or
before the ranks said where they listen) goes into a full staging copy on rank 0 and, once every layer is
checked, each rank gets its layers and heads from it (``import_blocks``).

Only host-staged frames: the ranks' copies and the scatter run between steps on the worker's loop, so
neither layer-by-layer streaming during the forward nor a peer's direct writes into rank 0's cache can
take part.
"""

from collections.abc import Callable

import torch

from kvrelay.shared.engine.kv_connector import EngineKV
from kvrelay.shared.handoff.base import KVReceiver, Transport
from kvrelay.shared.handoff.rank_parts import PartAssembler
from kvrelay.shared.wire.handoff import KVLayers


def frames_only(transports: list[Transport]) -> list[Transport]:
    """The transports a sharded worker may use: none that writes another worker's cache directly."""
    return [t for t in transports if not t.writes_directly]


def exported(kv: EngineKV, block_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(a full-head copy of ``block_ids`` as a cache of its own, that cache's block ids)."""
    return kv.export_blocks(block_ids), list(range(len(block_ids)))


class WorkerDown(ValueError):
    """This worker's rank group is down: it admits nothing more (it is leaving), so the prefill side runs the
    request again elsewhere rather than failing it."""


class ImportingReceiver(KVReceiver):
    """A transport's receiver into a full staging cache of the granted blocks (every layer, every head);
    ``finish`` scatters it to the ranks' caches."""

    def __init__(self, kv: EngineKV, block_ids: list[int], transport: Transport, offered: bool,
                 on_done: Callable[..., None], frames_key: bytes = b""):
        cache = kv.kv_cache
        _, two, _, block_size, _, head_dim = cache.shape
        self.kv, self.block_ids = kv, block_ids
        self.staging = cache.new_empty((kv.num_layers, two, len(block_ids), block_size, kv.num_kv_heads, head_dim))
        self.inner = transport.receiver(self.staging, list(range(len(block_ids))), offered, on_done, frames_key)

    def add(self, msg: KVLayers, frames: list) -> None:
        self.inner.add(msg, frames)

    def error(self) -> Exception | None:
        return self.inner.error()

    @property
    def complete(self) -> bool:
        return self.inner.complete

    def finish(self) -> None:
        self.inner.finish()
        self.kv.import_blocks(self.block_ids, self.staging)

    def abandon(self) -> None:
        self.inner.abandon()


class ByRankReceiver(KVReceiver):
    """A "rank_layers" transfer whose parts go to each of this worker's ranks itself (``EngineKV.part_targets``):
    rank 0 takes its own share into its own cache, and the transfer is complete once every other rank reported
    its share in (shared/engine/ranks/kv_inlet.py). No staging copy, no scatter."""

    def __init__(self, kv: EngineKV, request_id: str, block_ids: list[int], on_done: Callable[..., None]):
        self.kv, self.request_id = kv, request_id
        self.inner = PartAssembler(kv.kv_cache, block_ids, on_done=on_done)  # rank 0's share starts at (0, 0)
        self.wakes_on = kv.rank_reports  # the other ranks' reports land the transfer as soon as the last is in
        self.ranks_done = False

    def add(self, msg: KVLayers, frames: list) -> None:
        self.inner.add(msg, frames)

    def error(self) -> Exception | None:
        error = self.inner.error()
        if error is not None:
            return error
        self.ranks_done, failed, down = self.kv.ranks_received(self.request_id)
        if down:
            return WorkerDown(f"a rank's share of the KV failed: {failed}")
        return ValueError(f"a rank's share of the KV failed: {failed}") if failed else None

    @property
    def complete(self) -> bool:
        if not self.ranks_done:
            self.ranks_done = self.kv.ranks_received(self.request_id)[0]
        return self.ranks_done and self.inner.complete

    def finish(self) -> None:
        self.inner.finish()
        self.kv.drop_parts(self.request_id, done=True)

    def abandon(self) -> None:
        self.inner.abandon()
        self.kv.drop_parts(self.request_id)  # before the blocks go back: no rank still writes them
