"""KV sent by the ranks of a tensor- or pipeline-parallel prefill worker, each rank its own part (its stage's
layers, its KV heads: shared/engine/ranks/kv_parts.py), from a socket of its own; KVHeader.transport
"rank_layers". A one-rank prefill worker sends the same parts, every layer and head, when the grant names the
decode worker's ranks (``EngineKV.sends_parts_to``). Rank 0 keeps the transfer's control plane: it asks for the grant, sends the header once its
ranks were told to send (so it may arrive before some parts: the decode side waits for them), reads the
ack, cancels, and holds the deadlines.

The decode side knows a part by ``KVLayers.heads`` and matches it to the grant by ``KVLayers.requester`` (the
connection it comes from is a rank's, not the grant's) and ``KVLayers.epoch`` (a part of an earlier grant of the
request, given up, may still be on its way from a rank's socket when the request is granted again).
``PartAssembler`` places each part by layer and head into the granted blocks of a one-rank cache, or of a
sharded receiver's rank 0 when the grant named every decode rank's share (``HandoffGrant.targets``: each prefill
rank splits its part among them, and each other decode rank takes its share itself,
shared/engine/ranks/kv_inlet.py; sharded.py ``ByRankReceiver``), so the heads are regrouped on the way whatever
either side's layout. Its state per transfer is the (layer, head) grid: a part overlapping one already taken, or
of the wrong size, is refused; the transfer is complete once every (layer, head) arrived and passed its CRC. A
part that never comes (its rank died) leaves the transfer incomplete: the decode side fails it when no progress
was made for the grant's TTL, and the prefill side cancels it at once when it sees its group go down.
"""

from collections.abc import Callable

import torch

from kvrelay.shared.engine.kv_connector import EngineKV
from kvrelay.shared.engine.kv_frame import check_crcs, frame_bytes
from kvrelay.shared.handoff.assembler import FrameAssembler
from kvrelay.shared.handoff.base import KVReceiver, KVSender, Send, Transport
from kvrelay.shared.handoff.blocks import frame_nbytes
from kvrelay.shared.wire.handoff import HandoffGrant, KVLayers


class RankParts(Transport):
    """The decode side's receiver of parts; a sender comes from ``RankPartsSender`` (it needs the engine's
    ranks, not a cache), never from this transport's ``sender``."""

    name = "rank_layers"

    def sender(self, model: str, kv_cache: torch.Tensor, src_blocks: list[int], grant: HandoffGrant, peer: str,
               grant_age_s: float, deferred: bool, on_ready: Callable[..., None]) -> KVSender | None:
        return None

    def receiver(self, kv_cache: torch.Tensor, block_ids: list[int], offered: bool,
                 on_done: Callable[..., None], frames_key: bytes = b"") -> KVReceiver:
        return PartAssembler(kv_cache, block_ids, on_done=on_done)


class RankPartsSender(KVSender):
    """Rank 0's view of a transfer its ranks send: every rank is told at once (``EngineKV.send_parts``), and
    the header may follow as soon as rank 0's own part (a one-rank sender's: every decode rank's share) is
    queued."""

    transport = RankParts.name

    def __init__(self, kv: EngineKV, request_id: str, src_blocks: list[int], peer: str, requester: str,
                 deadline_s: float, grant: HandoffGrant):
        self.kv = kv
        self.num_layers = kv.num_layers
        self.nbytes = kv.num_layers * frame_nbytes(kv.kv_cache, len(src_blocks), kv.num_kv_heads)
        self.driver_nbytes = kv.send_parts(request_id, src_blocks, peer, requester, grant.epoch, deadline_s,
                                           grant.targets)

    def stage_through(self, layer: int) -> None:
        return None  # a sharded group's KV moves between steps, never during the forward

    def pump(self, request_id: str, send: Send) -> bool:
        return self.kv.flush_parts()

    def source_free(self) -> bool:
        return True  # every rank copied its part out before it takes its next step (kv_parts.py)

    def wait_source(self) -> None:
        return None


class PartAssembler(FrameAssembler):
    """One transfer arriving in parts: each KVLayers part is sized against this cache's layout and the
    (layer, head) grid on arrival, then CRC-checked and written into its layers and heads of the granted
    blocks by a pool thread."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], on_done=None):
        self.num_layers, self.num_heads = kv_cache.shape[0], kv_cache.shape[4]
        self.head_nbytes = frame_nbytes(kv_cache, len(block_ids), 1)  # one layer of one head
        super().__init__(kv_cache, block_ids, self.head_nbytes * self.num_heads * self.num_layers, on_done)
        self.missing = torch.ones(self.num_layers, self.num_heads, dtype=torch.bool)  # (layer, head) not yet here
        self.parts = 0

    def add(self, msg: KVLayers, frames: list) -> None:
        if not msg.is_part:
            raise ValueError("a KV layers message without its heads inside a transfer its ranks send")
        (first_head, count_heads), count = msg.heads, len(msg.checksums)
        if msg.first + count > self.num_layers or first_head + count_heads > self.num_heads:
            raise ValueError(f"a KV part of layers {msg.first}..{msg.first + count - 1}, heads {first_head}.."
                             f"{first_head + count_heads - 1} for a model of {self.num_layers} x {self.num_heads}")
        cells = self.missing[msg.first:msg.first + count, first_head:first_head + count_heads]
        if not bool(cells.all()):
            raise ValueError(f"a KV part of layers {msg.first}..{msg.first + count - 1}, heads {first_head}.."
                             f"{first_head + count_heads - 1} overlaps one already taken")
        if len(frames) != 1:
            raise ValueError(f"a KV layers message has {len(frames)} frames, not 1")
        size, want = memoryview(frames[0]).nbytes, count_heads * self.head_nbytes
        if msg.nbytes != want or size != count * want:
            raise ValueError(f"KV part frame of {size} bytes for {count} layers of {msg.nbytes}, expected "
                             f"{count} x {want}")
        cells.fill_(False)
        self.parts += 1
        self._write(self._check_and_write, msg.first, first_head, msg.checksums, frames[0])

    @property
    def all_arrived(self) -> bool:
        return not bool(self.missing.any())

    def _check_and_write(self, first: int, first_head: int, checksums: list[int], frame) -> None:
        data = memoryview(frame)
        check_crcs(data, first, checksums)
        size = data.nbytes // len(checksums)
        shape = (len(checksums), 2, self.num_blocks, self.kv_cache.shape[3], size // self.head_nbytes,
                 self.kv_cache.shape[5])
        # an fp8 cache as its bytes: index copies need not support float8 on every device
        cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
        part = frame_bytes(data).view(cache.dtype).view(shape)
        dst = cache.narrow(0, first, shape[0]).narrow(4, first_head, shape[4])
        self._to_device(lambda src: dst.index_copy_(2, self.index, src), part)
