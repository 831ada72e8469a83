"""The handoff's interfaces: a transport gives one sender per transfer on the prefill side and one
receiver per transfer on the decode side (after SGLang's ``BaseKVSender`` / ``BaseKVReceiver``, with
the poll state of a transfer in states.py). The mechanics (sender.py, receiver.py) drive them and
never look at which transport they hold; a worker picks its transports once, in order of preference:

- ``DirectWrite(CudaIpc())`` (direct.py, cuda_ipc.py): the decode worker shares its KV cache with an
  asker on the same GPU, which copies its blocks straight into the granted ones; ZMQ carries control.
- ``Frames()`` (frames.py): host-staged layers over ZMQ, CRC- or MAC-checked; works between any two hosts.
- ``DirectWrite(InProcess())`` (fake.py): direct writes between caches of one process, so the
  direct-write logic (offers, mappings, quarantine, streamed copies) runs in CPU tests.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
import zmq

from kvrelay.shared.wire.handoff import HandoffGrant, HandoffRequest, KVIpcHandle, KVLayers


class Send(Protocol):
    def __call__(self, parts: list, stream: int = 0) -> bool:
        """Queue one multipart message to the transfer's peer (on its ``stream``-th of ``KVSender.to``, where the
        sender has those); False when that queue is full."""


class KVSender(ABC):
    """One transfer's KV leaving the prefill side for the blocks its grant named."""

    transport: ClassVar[str]  # KVHeader.transport
    nbytes: int  # of KV, all layers
    num_layers: int
    # where its messages go: the grant's plain bulk sockets (HandoffGrant.frames_addrs); none: the grant's own
    to: tuple[str, ...] = ()

    @abstractmethod
    def stage_through(self, layer: int) -> None:
        """The prefill has written layers 0..``layer`` (queued on the compute stream): move them."""

    @abstractmethod
    def pump(self, request_id: str, send: Send) -> bool:
        """Move on whatever is ready, without blocking; True once all the KV is with the receiver or
        queued on its socket, so the header may follow."""

    @abstractmethod
    def source_free(self) -> bool:
        """Nothing reads the source blocks any more: the engine may reuse them."""

    @abstractmethod
    def wait_source(self) -> None:
        """Block until ``source_free()`` (before freeing the blocks of a failed or cancelled transfer)."""


class KVReceiver(ABC):
    """One transfer's KV arriving on the decode side in the blocks it granted. Nobody reads those
    blocks before ``finish()``, so a transfer that fails half-way harms nothing once ``abandon()``
    returned and the blocks are freed."""

    # a socket whose messages may complete it besides its own writes (which call ``on_done``): the decode
    # loop wakes for it too; ``error`` reads what arrived on it
    wakes_on: zmq.Socket | None = None

    @abstractmethod
    def add(self, msg: KVLayers, frames: list) -> None:
        """A KVLayers message and its frame; ValueError when they are not what was due."""

    @abstractmethod
    def error(self) -> Exception | None:
        """The first failure among the KV processed so far."""

    @property
    @abstractmethod
    def complete(self) -> bool:
        """All the KV is in the blocks (or failed: see ``error``)."""

    @abstractmethod
    def finish(self) -> None:
        """Once complete and error-free: every write has landed before anyone reads the blocks."""

    @abstractmethod
    def abandon(self) -> None:
        """Wait out in-flight writes so the blocks can be freed."""


class Transport(ABC):
    name: ClassVar[str]  # KVHeader.transport of what it moves
    writes_directly: ClassVar[bool] = False  # the sender writes granted blocks itself (they need a quarantine)

    def locality(self, kv_cache: torch.Tensor) -> str:
        """Asker: where its KV lives, for HandoffRequest.device_uuid ("" offers nothing)."""
        return ""

    def offer(self, model: str, kv_cache: torch.Tensor, req: HandoffRequest) -> KVIpcHandle | None:
        """Decode side: what a grant to ``req`` carries for this transport (None: nothing to offer)."""
        return None

    @abstractmethod
    def sender(self, model: str, kv_cache: torch.Tensor, src_blocks: list[int], grant: HandoffGrant, peer: str,
               grant_age_s: float, deferred: bool, on_ready: Callable[..., None]) -> KVSender | None:
        """A sender of ``src_blocks`` into ``grant``'s blocks at ``peer``, or None when this transport
        cannot serve the grant. ``deferred``: layers move as ``stage_through`` says they are written."""

    @abstractmethod
    def receiver(self, kv_cache: torch.Tensor, block_ids: list[int], offered: bool,
                 on_done: Callable[..., None], frames_key: bytes = b"") -> KVReceiver:
        """A receiver into ``block_ids``; ``offered``: this grant carried our offer; ``frames_key``: the
        grant's key of MAC'd frames (HandoffGrant.frames_key). ValueError when a transfer over this
        transport cannot be accepted for that grant."""

    def forget(self, model: str) -> None:
        """The model instance was unloaded here: drop what is held for it (nothing, by default)."""
        return None

    def retain(self, live_peers: set[str]) -> None:
        """Only these peers are alive: drop what is held for the others (nothing, by default)."""
        return None

    def close(self) -> None:
        """The worker is shutting down (nothing to release, by default)."""
        return None
