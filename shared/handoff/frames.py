"""Host-staged frames over ZMQ: the portable transport, between any two hosts.

A transfer is KVLayers messages, each one frame of a few consecutive layers (~4 MB) with a CRC32 per
layer, sent as soon as the layers are staged (device gather + copy into pinned host memory, or a numpy
gather on CPU), then the KVHeader. Staging, the CRC, the wire and the receiver's CRC + write of earlier
layers overlap instead of running back to back. The receiver sizes every frame against its own layout
and checks every CRC before a byte lands in the granted blocks.

A grant that names bulk sockets (``HandoffGrant.frames_addrs``, a CURVE deployment's default) takes its
frames there instead: plain sockets, so the frames are NOT secret on the wire (CURVE, which encrypts on one
libzmq I/O thread a connection, cut them to a third), but each carries a MAC under the grant's own random key
in place of the CRCs, checked before any byte lands: only the peer the grant went to (over CURVE) can make
one, and no frame passes for another grant's or another layer's. Group ``g`` goes to bulk socket ``g % N``:
one connection's bytes move on one I/O thread, so N connections move them on N, and the receiver places each
frame by the layers it names, in whatever order the sockets deliver them. ``--encrypt-kv-frames`` keeps them
on the CURVE socket, for networks between hosts that are not trusted.

Frames reach ZMQ zero-copy (memoryviews over the staging buffer); the receiver is bounded by ZMQ's
MAXMSGSIZE (``max_message_bytes``). Gathers, CRCs or MACs and writes run on a small thread pool (numpy, torch,
zlib and OpenSSL release the GIL), so a 268 MB transfer does not stall either worker's main loop; the main
loops only hand messages to and from the sockets.
"""

from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from kvrelay.shared.engine.kv_frame import check_crcs, check_mac, frame_bytes, frame_mac, layer_crcs
from kvrelay.shared.handoff.assembler import FrameAssembler
from kvrelay.shared.handoff.base import KVReceiver, KVSender, Send, Transport
from kvrelay.shared.handoff.blocks import frame_nbytes, gather_blocks, scatter_blocks, side_stream
from kvrelay.shared.handoff.pool import INLINE_BYTES, submit
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import HandoffGrant, KVLayers

MESSAGE_TARGET = 4 << 20  # bytes of KV per KVLayers message (whole layers)


class Frames(Transport):
    name = "layers"

    def sender(self, model: str, kv_cache: torch.Tensor, src_blocks: list[int], grant: HandoffGrant, peer: str,
               grant_age_s: float, deferred: bool, on_ready: Callable[..., None]) -> KVSender:
        return StagedKV(kv_cache, src_blocks, on_ready=on_ready, deferred=deferred, epoch=grant.epoch,
                        key=grant.frames_key, to=tuple(grant.frames_addrs))

    def receiver(self, kv_cache: torch.Tensor, block_ids: list[int], offered: bool,
                 on_done: Callable[..., None], frames_key: bytes = b"") -> KVReceiver:
        return LayerAssembler(kv_cache, block_ids, on_done=on_done, key=frames_key)


def max_message_bytes(kv_cache: torch.Tensor, max_blocks: int, num_kv_heads: int | None = None) -> int:
    """The receive bound (ZMQ MAXMSGSIZE, which applies per frame) for KV from a peer with this layout
    and prompts of up to ``max_blocks`` blocks: a frame is whole layers of up to MESSAGE_TARGET bytes,
    or one layer when a layer alone is bigger. Control messages fit the extra MiB. A peer sending more
    is disconnected by ZMQ before anything is buffered. ``num_kv_heads``: all of the model's, when the
    cache holds one tensor-parallel rank's share (frames carry every head)."""
    return max(MESSAGE_TARGET, frame_nbytes(kv_cache, max_blocks, num_kv_heads)) + (1 << 20)


def layers_per_message(num_layers: int, layer_nbytes: int) -> int:
    """Consecutive layers sent in one message: whole layers of ~MESSAGE_TARGET bytes. Per-message costs
    (a send, a receive, a decode, a pool task, a wake-up) would swamp small transfers one layer at a time;
    big ones still go out in pieces that overlap with staging and writing."""
    return max(1, min(num_layers, MESSAGE_TARGET // max(layer_nbytes, 1)))


def _as_bytes(frame: torch.Tensor) -> memoryview:
    return memoryview(frame.view(torch.uint8).reshape(-1).numpy())


class StagedKV(KVSender):
    """One transfer's layers staged out of the sender's cache into host memory, in the background, in
    groups of ``layers_per_message`` (group ``g`` = layers ``g * per .. g * per + per - 1``).

    On CUDA a group's gather and device-to-host copy is queued on the side stream (after the compute
    stream, which wrote the KV), into one pinned buffer, with an event per group; pool threads wait for
    a group's event and CRC its layers (or, with the grant's ``key``, MAC the frame). On CPU the pool
    threads gather and CRC (or MAC).
    All groups are staged at once, or with ``deferred`` group by group as ``stage_through(layer)`` says
    the prefill has written that layer (the layer-by-layer overlap with the prompt's last chunk)."""

    transport = Frames.name

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], on_ready=None, deferred: bool = False,
                 epoch: int = 0, key: bytes = b"", to: tuple[str, ...] = ()):
        self.kv_cache, self.epoch = kv_cache, epoch  # the grant's, stamped on every message
        self.key, self.to = key, to
        self.num_layers = kv_cache.shape[0]
        self.layer_nbytes = frame_nbytes(kv_cache, len(block_ids))
        self.nbytes = self.layer_nbytes * self.num_layers
        self.per_message = layers_per_message(self.num_layers, self.layer_nbytes)
        self.groups = [range(g, min(g + self.per_message, self.num_layers))
                       for g in range(0, self.num_layers, self.per_message)]
        self.inline = self.nbytes <= INLINE_BYTES
        self.on_ready = on_ready
        self.sent = 0  # groups queued on the socket
        self._events: list = []
        self._futures: list[Future] = []  # one per staged group, in order
        self._host = None
        if kv_cache.is_cuda:
            self._host = torch.empty((self.num_layers, 2, len(block_ids)) + tuple(kv_cache.shape[3:]),
                                     dtype=kv_cache.dtype, pin_memory=True)
            with torch.cuda.stream(side_stream(kv_cache.device)):
                self.index = torch.tensor(block_ids, dtype=torch.long).to(kv_cache.device, non_blocking=True)
        else:
            self.index = torch.tensor(block_ids, dtype=torch.long)
        if not deferred:
            self.stage_through(self.num_layers - 1)

    def stage_through(self, layer: int) -> None:
        """Stage every group whose layers are all at or below ``layer``."""
        while len(self._futures) < len(self.groups) and self.groups[len(self._futures)].stop - 1 <= layer:
            g = self.groups[len(self._futures)]
            if self._host is not None:
                stream = side_stream(self.kv_cache.device)
                stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
                with torch.cuda.stream(stream):
                    self._host[g.start:g.stop].copy_(gather_blocks(self.kv_cache, g, self.index), non_blocking=True)
                    self._events.append(torch.cuda.Event())
                    self._events[-1].record(stream)
                future = submit(self.inline, self._seal_after, self._host[g.start:g.stop], self._events[-1], g)
            else:
                future = submit(self.inline, self._gather_seal, g)
            self._futures.append(future)
            if self.on_ready is not None:
                future.add_done_callback(self.on_ready)

    @property
    def num_messages(self) -> int:
        return len(self.groups)

    def ready(self, group: int) -> bool:
        return group < len(self._futures) and self._futures[group].done()

    def result(self, group: int) -> tuple[memoryview, list[int], bytes]:
        """(frame, CRC32 of each layer in it or none, its MAC or b"") of a staged group of layers; blocks until
        it is staged."""
        return self._futures[group].result()

    def message(self, request_id: str, group: int) -> list:
        frame, crcs, mac = self.result(group)
        msg = KVLayers(request_id=request_id, first=group * self.per_message, nbytes=self.layer_nbytes, checksums=crcs,
                       epoch=self.epoch, mac=mac)
        return [encode(msg), frame]

    def pump(self, request_id: str, send: Send) -> bool:
        while self.sent < self.num_messages and self.ready(self.sent):
            if not send(self.message(request_id, self.sent), self.sent % max(len(self.to), 1)):
                return False  # the peer's queue is full: again on the next poll, until the deadline
            self.sent += 1
        return self.sent == self.num_messages

    def source_free(self) -> bool:
        if len(self._futures) < len(self.groups):
            return False
        if self._events:
            return all(ev.query() for ev in self._events)
        return all(f.done() for f in self._futures)

    def wait_source(self) -> None:
        """Groups never staged never read the source blocks."""
        for ev in self._events:
            ev.synchronize()
        wait(self._futures)


    def _seal_after(self, layers: torch.Tensor, event, group: range) -> tuple[memoryview, list[int], bytes]:
        event.synchronize()
        return self._seal(_as_bytes(layers), group)

    def _gather_seal(self, group: range) -> tuple[memoryview, list[int], bytes]:
        return self._seal(_as_bytes(gather_blocks(self.kv_cache, group, self.index)), group)

    def _seal(self, frame: memoryview, group: range) -> tuple[memoryview, list[int], bytes]:
        if self.key:  # the MAC is the stronger check: no CRC besides
            return frame, [], frame_mac(self.key, frame, group.start, self.layer_nbytes)
        return frame, layer_crcs(frame, len(group)), b""


class LayerAssembler(FrameAssembler):
    """One incoming transfer: each KVLayers message's frame is counted, sized and placed on arrival against
    this cache's layout, then CRC-checked (or, its grant having a ``key``, MAC-checked) and written into
    the granted blocks by a pool thread. Frames dealt across several bulk sockets arrive in any order: each
    names its layers, and a layer that came already, or past the last, fails the transfer. The header, which
    comes last, must describe the same layout (``check_layout``)."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], on_done=None, key: bytes = b""):
        self.num_layers = kv_cache.shape[0]
        self.layer_nbytes = frame_nbytes(kv_cache, len(block_ids))
        super().__init__(kv_cache, block_ids, self.layer_nbytes * self.num_layers, on_done)
        self.key = key
        self.taken = [False] * self.num_layers  # each layer's frame arrived
        self.arrived = 0  # layers

    def add(self, msg: KVLayers, frames: list) -> None:
        if len(frames) != 1:
            raise ValueError(f"a KV layers message has {len(frames)} frames, not 1")
        if msg.mac and not self.key:
            raise ValueError("a MAC'd KV frame for a grant that gave no key")
        size = memoryview(frames[0]).nbytes
        count = len(msg.checksums) or size // max(msg.nbytes, 1)
        if msg.first + count > self.num_layers or any(self.taken[msg.first:msg.first + count]):
            raise ValueError(f"KV layers {msg.first}..{msg.first + count - 1} arrived again or past the "
                             f"{self.num_layers} layers")
        if msg.nbytes != self.layer_nbytes or size != count * self.layer_nbytes or count < 1:
            raise ValueError(f"KV layers frame of {size} bytes for {count} layers of {msg.nbytes}, expected "
                             f"{count} x {self.layer_nbytes}")
        self._write(self._check_and_write, msg, count, frames[0])
        self.taken[msg.first:msg.first + count] = [True] * count
        self.arrived += count

    @property
    def all_arrived(self) -> bool:
        return self.arrived == self.num_layers

    def _check_and_write(self, msg: KVLayers, count: int, frame) -> None:
        first = msg.first
        if msg.mac:
            check_mac(self.key, memoryview(frame), first, self.layer_nbytes, msg.mac)
        else:
            check_crcs(memoryview(frame), first, msg.checksums)
        shape = (count, 2, self.num_blocks) + tuple(self.kv_cache.shape[3:])
        layers = frame_bytes(frame).view(self.kv_cache.dtype).view(shape)
        self._to_device(lambda src: scatter_blocks(self.kv_cache, first, self.index, src), layers)
