"""Each rank of a tensor- or pipeline-parallel prefill group sends its own part of a prompt's KV blocks (its
stage's layers, its KV heads of them) straight to the decode worker, from a socket of its own: the data
plane of a sharded handoff is the ranks', its control (grant, header, ack, cancel, deadlines) stays with
rank 0, the worker the decode side knows (shared/handoff/rank_parts.py is the handoff's half).

Rank 0 sends ``RankKVSend`` to the others over the step broadcast and then sends its own part; every rank
copies its part out of its cache before it reads its next message (the ranks take rank 0's messages in
order), so rank 0 may release the prompt's blocks at once: a later step reusing them runs after every
copy. Each part is KVLayers messages of whole layers (~4 MB a message) of the rank's heads, a CRC32 per
layer, saying which layers (``first``) and which of the model's KV heads (``heads``) the frame holds; the
decode side places them by layer and head whatever its own layout. A head several ranks hold (fewer KV
heads than ranks) is sent by the first of them only. When the grant names the decode worker's ranks
(``RankKVSend.targets``: each one's address, layers and heads), the part is split among them (``shares``) and
each decode rank gets what it holds at its own socket (kv_inlet.py), a replica of a head its own copy. A
prefill worker of one process sends this way too when the grant names decode ranks: it is the group of one
rank, whose part is every layer and head, and its worker's process is that rank (``driver_send``).

The frames are staged on the host (a device gather, then a copy to host memory), so the code is the same
on CPU and CUDA; under CUDA each rank sends over its own host's link rather than funnelling every byte
through rank 0 (not measured here: the project's CI has no GPU). A part waits for room on its socket
(ZMQ's queue is bounded) at most the transfer's deadline, then is dropped: the decode side fails the
transfer for the missing part, and rank 0 gives it up.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from kvrelay.kernels.kv_quant import FP8_KV_DTYPE
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.engine.kv_frame import layer_crcs
from kvrelay.shared.engine.parallel.layout import RankLayout
from kvrelay.shared.engine.parallel.linear import kv_heads
from kvrelay.shared.engine.ranks.kv_moves import check_block_ids, stage_layers, total_kv_heads
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import KVLayers, KVTarget
from kvrelay.shared.wire.rank_step import RankKVSend

log = logging.getLogger(__name__)

MESSAGE_TARGET = 4 << 20  # bytes of KV per KVLayers message (whole layers), as shared/handoff/frames.py
SEND_HWM = 256  # queued messages per decode worker; bounds what a stalled peer can make a rank hold


@dataclass(frozen=True)
class Part:
    """One rank's share of a transfer: the model's layers ``layers`` and KV heads ``first_head`` ..
    ``first_head + num_heads - 1`` (its whole cache: a rank holds exactly its stage's layers and its heads)."""

    layers: range
    first_head: int
    num_heads: int


def rank_part(model, layout: RankLayout) -> Part | None:
    """This rank's part, or None when an earlier rank of its stage holds the same heads (it sends nothing)."""
    start, end = stage_layers(model)[layout.stage]
    total = total_kv_heads(model)
    first, count = kv_heads(total, layout.tp_rank, layout.tp)
    if any(kv_heads(total, r, layout.tp)[0] == first for r in range(layout.tp_rank)):
        return None
    return Part(range(start, end), first, count)


def shares(part: Part, targets: list[KVTarget]) -> list[tuple[str, Part]]:
    """(address, the share of ``part`` that target holds) for every target holding any of it; a decode rank's
    replica of a head gets its own copy. No targets: the whole part to the grant's socket ("")."""
    if not targets:
        return [("", part)]
    out = []
    for t in targets:
        start, end = max(part.layers.start, t.layers[0]), min(part.layers.stop, t.layers[1])
        first = max(part.first_head, t.heads[0])
        last = min(part.first_head + part.num_heads, t.heads[0] + t.heads[1])
        if start < end and first < last:
            out.append((t.address, Part(range(start, end), first, last - first)))
    return out


def part_messages(kv_cache: torch.Tensor, block_ids: list[int], part: Part, request_id: str,
                  requester: str, share: Part | None = None, epoch: int = 0) -> list[list]:
    """The KVLayers messages of ``share`` (default: all) of the rank's ``part`` for the grant ``epoch``, each
    ``[encoded message, frame]`` (frames over a host copy)."""
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype == FP8_KV_DTYPE else kv_cache
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    host = raw.index_select(2, index).cpu()  # [L_stage, 2, n, bs, heads, D]
    if host.shape[0] != len(part.layers) or host.shape[4] != part.num_heads:
        raise ValueError(f"a rank's cache of {host.shape[0]} layers x {host.shape[4]} heads for a part of "
                         f"{len(part.layers)} x {part.num_heads}")
    if share is not None and share != part:
        host = host.narrow(0, share.layers.start - part.layers.start, len(share.layers))
        host = host.narrow(4, share.first_head - part.first_head, share.num_heads)
        part = share
    host = host.contiguous()
    data = memoryview(host.view(torch.uint8).reshape(-1).numpy())
    layer_nbytes = data.nbytes // host.shape[0]
    per = max(1, min(host.shape[0], MESSAGE_TARGET // max(layer_nbytes, 1)))
    messages = []
    for g in range(0, host.shape[0], per):
        count = min(per, host.shape[0] - g)
        frame = data[g * layer_nbytes:(g + count) * layer_nbytes]
        crcs = layer_crcs(frame, count)
        msg = KVLayers(request_id=request_id, first=part.layers.start + g, nbytes=layer_nbytes, checksums=crcs,
                       heads=[part.first_head, part.num_heads], requester=requester, epoch=epoch)
        messages.append([encode(msg), frame])
    return messages


class PartSender:
    """A rank's sockets to decode workers (one DEALER each, CURVE as every internal socket) and the parts
    still waiting for room on them. Never reads: replies go to rank 0's socket, the grant's."""

    def __init__(self, links: KVLinks) -> None:
        self._keys = links.keys()
        self._ctx: zmq.Context | None = None  # made on the first part: most groups never send one
        self._socks: dict[str, zmq.Socket] = {}
        self._pending: deque[tuple[float, str, list]] = deque()  # (give-up time, peer, message)
        self.bytes_sent = 0  # KV bytes this rank queued for decode workers (its parts' frames)
        self.parts_sent = 0

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def send(self, msg: RankKVSend, kv_cache: torch.Tensor, part: Part | None) -> int:
        """Queue this rank's part of ``msg``'s blocks for its peer; the part's bytes (0 for a replica)."""
        if part is None:
            return 0
        give_up, nbytes = time.monotonic() + msg.deadline_s, 0
        for address, share in shares(part, msg.targets):
            messages = part_messages(kv_cache, msg.block_ids, part, msg.request_id, msg.requester, share, msg.epoch)
            self._pending.extend((give_up, address or msg.peer, m) for m in messages)
            nbytes += sum(m[1].nbytes for m in messages)
        self.bytes_sent += nbytes
        self.parts_sent += 1
        self.flush()
        return nbytes

    def flush(self) -> bool:
        """Queue what the sockets take now, without blocking; True once nothing waits."""
        now = time.monotonic()
        while self._pending:
            give_up, peer, message = self._pending[0]
            if now > give_up:
                self._pending.popleft()
                log.warning("dropped a KV part for %s: its socket took nothing before the deadline", peer)
                continue
            try:
                self._socket(peer).send_multipart(message, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._pending.popleft()
        return True

    def _socket(self, peer: str) -> zmq.Socket:
        sock = self._socks.get(peer)
        if sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._socks[peer] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            zmq_auth.dial(sock, self._keys)
            sock.connect(peer)
        return sock

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()


def driver_send(ranks, sender: PartSender, model, kv_cache: torch.Tensor, msg: RankKVSend) -> int:
    """Rank 0: every rank sends its part of ``msg``'s blocks; rank 0's own part's bytes. An engine of one
    process (``ranks`` None) is the group of one rank: its part is every layer and head, split among the
    grant's decode ranks like any rank's."""
    check_block_ids(kv_cache, msg.block_ids)
    if ranks is None:
        return sender.send(msg, kv_cache, rank_part(model, RankLayout(0, 1, 1)))
    ranks.send(msg)
    return sender.send(msg, kv_cache, rank_part(model, ranks.layout))
