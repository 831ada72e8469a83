"""Direct writes: the sender copies its blocks straight into the decode worker's granted blocks, and
ZMQ carries only control (grant, a header saying "written", ack). How the decode worker's cache is
reached is a ``Sharing``: CUDA IPC between processes on one GPU (cuda_ipc.py), or the in-process fake
(fake.py) that lets CPU tests run everything else here.

The decode worker shares its whole KV cache once per asker (``Exporter``), the grant carries that
handle (``KVIpcHandle``), the asker maps it once and keeps the mapping per decode worker (``Peers``),
and copies on a side stream behind the compute stream that wrote the KV (``DeviceCopy``); the header
goes out only once the copy completed, and the decode worker reads the blocks only after the header.
Trust: mapping lets a peer write the decode worker's cache, so it is only offered to an asker on the
same device, the opener checks the handle's layout against its own cache first, and the asker only
ever writes blocks the grant named, within half the grant's lifetime (the decode side quarantines
the blocks of a lapsed offer for a whole lifetime more). Any failure to map falls back to the next
transport (frames).
"""

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvrelay.shared.handoff.base import KVReceiver, KVSender, Send, Transport
from kvrelay.shared.handoff.blocks import DTYPE_NAMES, BlockCopy, ids_within, kv_strides, side_stream
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffRequest, KVIpcHandle, KVLayers

log = logging.getLogger(__name__)

MAX_PEERS = 64  # exports per decode worker: one per prefill worker that ever asked


class IpcError(RuntimeError):
    pass


class Sharing(ABC):
    """How one process reaches another's KV cache."""

    @abstractmethod
    def locality(self, kv_cache: torch.Tensor) -> str:
        """Who can map this cache: equal strings can ("" for nobody)."""

    @abstractmethod
    def export(self, kv_cache: torch.Tensor) -> KVIpcHandle:
        """Share ``kv_cache`` for one consumer."""

    @abstractmethod
    def open(self, h: KVIpcHandle, like: torch.Tensor) -> torch.Tensor:
        """Map a peer's cache next to ``like``, after ``check_handle_layout``; IpcError when it cannot."""


def check_handle_layout(h: KVIpcHandle, like: torch.Tensor) -> None:
    """Raise IpcError unless ``h`` is a KV cache of ``like``'s layout (any block count), dense and inside
    its shared storage."""
    if h.dtype != DTYPE_NAMES[like.dtype]:
        raise IpcError(f"peer KV dtype {h.dtype} != {DTYPE_NAMES[like.dtype]}")
    if h.shape[:2] != list(like.shape[:2]) or h.shape[3:] != list(like.shape[3:]):
        raise IpcError(f"peer KV shape {h.shape} does not match {list(like.shape)} outside the block dimension")
    if h.stride not in (kv_strides(h.shape, block_major=False), kv_strides(h.shape, block_major=True)):
        raise IpcError(f"peer KV strides {h.stride} are neither layer- nor block-major for shape {h.shape}")
    if (h.tensor_offset + math.prod(h.shape)) * like.element_size() > h.storage_size:
        raise IpcError("peer KV tensor extends past its shared storage")


class DirectWrite(Transport):
    name = "ipc"
    writes_directly = True

    def __init__(self, sharing: Sharing):
        self.sharing = sharing
        self.exporters: dict[str, Exporter] = {}  # decode side: model instance -> its cache's handles
        self.peers: dict[str, Peers] = {}  # prefill side: model instance -> mapped decode caches
        self._refused: set[str] = set()  # decode workers we could not map: warned once

    def locality(self, kv_cache: torch.Tensor) -> str:
        return self.sharing.locality(kv_cache)

    def offer(self, model: str, kv_cache: torch.Tensor, req: HandoffRequest) -> KVIpcHandle | None:
        exporter = self.exporters.get(model)
        if exporter is None:
            exporter = self.exporters[model] = Exporter(kv_cache, self.sharing)
        return exporter.offer(req.requester, req.device_uuid)

    def sender(self, model: str, kv_cache: torch.Tensor, src_blocks: list[int], grant: HandoffGrant, peer: str,
               grant_age_s: float, deferred: bool, on_ready: Callable[..., None]) -> KVSender | None:
        # the copy must land well inside the grant's lifetime: the decode side quarantines the blocks of
        # a lapsed offer for as long again, and not longer
        if grant.ipc is None or not self.locality(kv_cache) or grant_age_s >= grant.ttl_s / 2:
            return None
        peers = self.peers.get(model)
        if peers is None:
            peers = self.peers[model] = Peers(kv_cache, self.sharing)
        try:
            copy = DeviceCopy(kv_cache, src_blocks, peers.open(peer, grant.ipc), grant.block_ids, deferred)
        except (IpcError, RuntimeError) as exc:  # torch reports CUDA refusals as RuntimeError
            if peer not in self._refused:  # once per decode worker: it stays refused
                self._refused.add(peer)
                log.warning("direct KV writes to %s unavailable, sending frames: %s", peer, exc)
            return None
        if not deferred:
            # the copy is device-local (~0.15 ms for 268 MB) and the compute stream is idle between
            # steps, where grants are handled: waiting for it beats waiting for the next poll
            copy.wait()
        return copy

    def receiver(self, kv_cache: torch.Tensor, block_ids: list[int], offered: bool,
                 on_done: Callable[..., None], frames_key: bytes = b"") -> KVReceiver:
        if not offered:
            raise ValueError("KV claims to be written through CUDA IPC, which this grant did not offer")
        return Written()

    def forget(self, model: str) -> None:
        self.exporters.pop(model, None)
        peers = self.peers.pop(model, None)
        if peers is not None:
            peers.mapped.clear()  # unmap: the decode workers' IPC reference counts drop back

    def retain(self, live_peers: set[str]) -> None:
        for peers in self.peers.values():
            peers.retain(live_peers)

    def close(self) -> None:
        for peers in self.peers.values():
            peers.mapped.clear()


class Exporter:
    """Decode side: the handle to put in a grant, if the asker can use one. One export per asker:
    CUDA counts one consumer per export, and that count keeps the memory from being reused while a
    peer still maps it."""

    def __init__(self, kv_cache: torch.Tensor, sharing: Sharing):
        self.kv_cache, self.sharing = kv_cache, sharing
        self.locality = sharing.locality(kv_cache)
        self.handles: dict[str, KVIpcHandle] = {}
        self.broken = False

    def offer(self, requester: str, asker_locality: str) -> KVIpcHandle | None:
        if self.broken or not self.locality or asker_locality != self.locality or not requester:
            return None
        h = self.handles.get(requester)
        if h is None:
            if len(self.handles) >= MAX_PEERS:
                return None
            try:
                h = self.handles[requester] = self.sharing.export(self.kv_cache)
            except (RuntimeError, AttributeError) as exc:  # e.g. an allocator without IPC support
                log.warning("KV cache export failed, using frames from now on: %s", exc)
                self.broken = True
                return None
        return h


class Peers:
    """Prefill side: one mapping per decode worker, opened on first use and kept."""

    def __init__(self, kv_cache: torch.Tensor, sharing: Sharing):
        self.kv_cache, self.sharing = kv_cache, sharing
        self.mapped: dict[str, tuple[bytes, torch.Tensor]] = {}
        # handles that failed to map, or that we unmapped: CUDA allows one open per export
        self.spent: set[bytes] = set()

    def open(self, peer: str, h: KVIpcHandle) -> torch.Tensor:
        key = h.handle + h.ref_counter + h.ref_counter_offset.to_bytes(8, "little")
        entry = self.mapped.get(peer)
        if entry is not None and entry[0] == key:
            return entry[1]
        if key in self.spent:
            raise IpcError("this handle failed to map before, or was already unmapped")
        if entry is not None:  # a new export (the peer restarted or re-shared): drop the old view
            self.spent.add(self.mapped.pop(peer)[0])
        try:
            check_handle_layout(h, self.kv_cache)
            tensor = self.sharing.open(h, self.kv_cache)
        except IpcError:
            self.spent.add(key)
            raise
        self.mapped[peer] = (key, tensor)
        log.info("mapped the KV cache of %s (%s blocks)", peer, h.shape[2])
        return tensor

    def retain(self, live_peers: set[str]) -> None:
        """Unmap the caches of decode workers that are gone."""
        for peer in [p for p in self.mapped if p not in live_peers]:
            self.spent.add(self.mapped.pop(peer)[0])


class DeviceCopy(KVSender):
    """Prefill side: one transfer's blocks copied into a mapped peer cache, all layers at once, or with
    ``deferred`` layer range by layer range as ``stage_through(layer)`` says the prefill has written
    them. On CUDA each range's copy runs on the side stream behind the compute stream as of that call;
    on CPU (the in-process fake) at once."""

    transport = DirectWrite.name

    def __init__(self, src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                 deferred: bool = False):
        if len(src_blocks) != len(dst_blocks):
            raise IpcError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
        if not ids_within(dst_blocks, dst.shape[2]):
            raise IpcError("destination block id out of the peer's range")
        self.src = src
        self.copy = BlockCopy(src, src_blocks, dst, dst_blocks)  # the block ids go to the device once
        self.nbytes = src[:, :, :1].numel() * src.element_size() * len(src_blocks)
        self.num_layers = src.shape[0]
        self.copied = 0  # layers queued so far
        self.event = None
        if not deferred:
            self.stage_through(self.num_layers - 1)

    def stage_through(self, layer: int) -> None:
        if layer < self.copied:
            return
        layers = range(self.copied, layer + 1)
        if not self.src.is_cuda:
            self.copy(layers)
        else:
            stream = side_stream(self.src.device)
            stream.wait_stream(torch.cuda.current_stream(self.src.device))  # the compute stream wrote this KV
            with torch.cuda.stream(stream):
                self.copy(layers)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        self.copied = layer + 1

    def done(self) -> bool:
        """Every layer copied (the side stream runs in order, so the last event covers them all)."""
        return self.copied == self.num_layers and (self.event is None or self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def pump(self, request_id: str, send: Send) -> bool:
        return self.done()  # nothing travels but the header: the header must not promise KV not landed yet

    def source_free(self) -> bool:
        return self.done()

    def wait_source(self) -> None:
        self.wait()


class Written(KVReceiver):
    """Decode side of a direct write: the sender waited for its copy before the header, so the blocks
    hold the KV when the header arrives."""

    def add(self, msg: KVLayers, frames: list) -> None:
        raise ValueError("KV layers for a transfer written through CUDA IPC")

    def error(self) -> Exception | None:
        return None

    @property
    def complete(self) -> bool:
        return True

    def finish(self) -> None:
        pass

    def abandon(self) -> None:
        pass
