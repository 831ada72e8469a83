"""The decode side's handoff mechanics: one socket's loop over grants (grants.py) and the transfers arriving
into them (incoming.py), the ack that lets the prefill side XACK the job. Which requests get blocks is the
decode role's (``reserve``, decode_worker/receiver.py).

Per request: HandoffRequest (or one of a step's HandoffRequests, answered by one HandoffGrants) -> granted
(blocks reserved, expiry armed; a direct-write offer when the asker shares our device) -> the transfer's first
KVLayers message, or a header saying the KV was written directly, opens a ``KVReceiver`` (base.py) -> the
header, which comes last and carries the first token, must match the grant and our layout -> once the receiver
is complete: admitted and acked. A bad layer, a bad header, or no progress for the grant's TTL frees the blocks
and nacks (while its asker still heartbeats, only MAX_GRANT_HOLD_S does). HandoffCancel frees a grant (or a
transfer's blocks) the sender gave up on, when it comes from the peer the grant was made to. Every grant has its
epoch (grants.py), which its KV, header, ack and cancel carry: a request id granted again has a new one, and what
comes for the old grant is dropped (``stale``).

With a bulk socket (plain, no CURVE: ``bulk``), every grant names it and carries a fresh key, and the frames come
there, each MAC'd under its grant's key (frames.py). Anyone who reaches that socket can send to it, so only MAC'd
frames of a frames transfer are taken from it, and a bad MAC fails the transfer before a byte lands.
"""

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import zmq

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.frames import Frames
from kvrelay.shared.handoff.grants import Busy, Grant, GrantBook
from kvrelay.shared.handoff.inbox_socket import InboxSocket
from kvrelay.shared.handoff.incoming import Incoming, check_header, receiver_for
from kvrelay.shared.handoff.rank_parts import RankParts
from kvrelay.shared.handoff.sharded import WorkerDown
from kvrelay.shared.handoff.transports import default_transports
from kvrelay.shared.wire.codec import decode_any
from kvrelay.shared.wire.handoff import (
    HandoffAck,
    HandoffCancel,
    HandoffGrant,
    HandoffGrants,
    HandoffRequest,
    HandoffRequests,
    KVHeader,
    KVLayers,
)

log = logging.getLogger(__name__)

MAX_SENDERS_COUNTED = 1024  # sending sockets whose KV bytes ``kv_bytes_by_sender`` keeps (the most recent)


class KVInbox(ABC):
    def __init__(self, sock: zmq.Socket, core_for, grant_ttl_s: float, transports: list[Transport] | None = None,
                 asker_alive: Callable[[str], bool] | None = None, bulk: tuple[zmq.Socket, str] | None = None):
        """``core_for(model)``: the EngineCore serving that model instance here, or None; the inbox works
        on its KV only through ``core.kv`` (shared/engine/kv_connector.py). ``asker_alive(worker_id)``:
        whether that prefill worker still heartbeats; its grants and stalled transfers then outlive their
        TTL (up to MAX_GRANT_HOLD_S): it reads our replies only between its engine steps, and one step
        can be longer than the TTL. None: every grant lapses at its TTL. ``bulk``: (a plain socket, the
        address senders dial it at) for MAC'd frames; None: frames come on ``sock`` with CRCs."""
        self.socket, self.core_for = InboxSocket(sock, bulk[0] if bulk else None), core_for
        self.transports = default_transports() if transports is None else transports
        self._by_name = {t.name: t for t in self.transports}
        # a sharded prefill worker's ranks send their parts themselves: taken whatever the transports chosen
        self._by_name.setdefault(RankParts.name, RankParts())
        self.book = GrantBook(core_for, grant_ttl_s, self.transports, asker_alive, bulk[1] if bulk else "")
        self.incoming: dict[str, Incoming] = {}
        self.bytes_received = 0
        # KV bytes taken per sending socket: a sharded prefill worker's ranks each send from their own
        self.kv_bytes_by_sender: dict[bytes, int] = {}
        self.stale = 0  # KV, headers and cancels of an earlier grant of a request id granted again, dropped
        self.refused_bulk = 0  # messages on the bulk socket that were no MAC'd frames

    @abstractmethod
    def reserve(self, req: HandoffRequest, pending: int, from_peer: int) -> list[int] | str:
        """The decode role's admission: the blocks allocated for ``req``, or why not (a ``Busy`` reason when
        only room is missing, so the asker waits instead of failing). ``pending``:
        transfers of its model granted or arriving here, which will join the batch; ``from_peer``: those
        of them its asker holds."""

    @property
    def grants(self) -> dict[str, Grant]:
        """Granted, the KV not yet arriving, by request id."""
        return self.book.grants

    @property
    def busy(self) -> bool:
        """KV granted or arriving: a draining worker waits for it."""
        return bool(self.grants or self.incoming)

    def has_model(self, model: str) -> bool:
        return self.book.has_model(model) or any(i.model == model for i in self.incoming.values())

    def forget_model(self, model: str) -> None:
        for transport in self.transports:
            transport.forget(model)

    def poll(self, timeout_ms: int, admit) -> int:
        """Handle every waiting message; ``admit(header)`` adds an arrived request to the batch.
        Returns the number of messages handled."""
        handled = 0
        # every transfer's receiver reads its socket in _advance (or the transfer ends): none stays ready
        self.socket.watch({s for inc in self.incoming.values() if (s := inc.receiver.wakes_on) is not None})
        for frames, bulk in self.socket.messages(timeout_ms):
            handled += 1
            if bulk:
                self._on_bulk(frames)
            else:
                self._on_message(frames)
        self._advance(admit)
        self._expire()
        return handled

    def _on_message(self, frames: list) -> None:
        if len(frames) < 2:
            log.warning("dropped a handoff message without a body")
            return
        peer, payload = frames[0].bytes, frames[2:]
        try:
            msg = decode_any(frames[1].bytes, HandoffRequest, HandoffRequests, KVHeader, KVLayers, HandoffCancel)
        except ValueError as exc:
            log.warning("dropped a malformed handoff message: %s", exc)
            return
        if isinstance(msg, HandoffRequest):
            self._reply(peer, self._grant(peer, msg))
        elif isinstance(msg, HandoffRequests):  # one step's asks: answered together
            self._reply(peer, HandoffGrants([self._grant(peer, req) for req in msg.requests]))
        elif isinstance(msg, HandoffCancel):
            self._on_cancel(peer, msg)
        elif isinstance(msg, KVLayers):
            self._on_layer(peer, msg, payload)
        else:
            self._on_header(peer, msg, payload)

    def _on_bulk(self, frames: list) -> None:
        """A message on the plain bulk socket, where anyone can send: a MAC'd frame goes on to be checked,
        anything else is counted and dropped (logged only at debug: no stranger fills our log)."""
        try:
            msg = decode_any(frames[1].bytes, KVLayers) if len(frames) >= 2 else None
        except ValueError:
            msg = None
        if msg is None or not msg.mac:
            self.refused_bulk += 1
            log.debug("dropped a message on the bulk socket that is no MAC'd KV frame (%d so far)", self.refused_bulk)
            return
        self._on_layer(frames[0].bytes, msg, frames[2:], bulk=True)

    def _grant(self, peer: bytes, req: HandoffRequest) -> HandoffGrant:
        rid = req.request_id
        # KV never came (or stopped coming) for an earlier grant: its prefill worker died and a peer
        # reclaimed the job. The newer asker wins; a late KV for the old grant is refused as misaddressed
        if rid in self.incoming:
            self._abort_incoming(rid, "superseded by a newer request for the same id")
        if rid in self.grants:
            self.book.release(rid)
        mine = [(g.peer, g.model) for g in self.grants.values()] + [(i.peer, i.model) for i in self.incoming.values()]
        pending = sum(1 for _, model in mine if model == req.model)
        blocks = self.reserve(req, pending, mine.count((peer, req.model)))
        if isinstance(blocks, str):
            return HandoffGrant(request_id=rid, accepted=False, reason=str(blocks), busy=isinstance(blocks, Busy),
                                ask=req.ask)
        return self.book.add(peer, req, blocks)

    def _open(self, peer: bytes, rid: str, transport: str) -> Incoming | None:
        """The grant's KV starts arriving: from here the sender is done writing blocks itself, so a
        failure frees them at once. None (and a nack) when the transport cannot take it."""
        grant = self.grants.pop(rid)
        kv = self.core_for(grant.model).kv
        try:
            receiver = receiver_for(kv, rid, grant, transport, self._by_name, self.socket.waker.wake)
        except ValueError as exc:
            kv.drop_parts(rid)
            kv.free(rid)
            log.warning("rejected KV for %s: %s", rid, exc)
            self._nack(peer, rid, str(exc), grant.epoch)
            return None
        inc = self.incoming[rid] = Incoming.of(grant, transport, receiver, time.monotonic())
        return inc

    def _epoch_of(self, rid: str) -> int | None:
        """The epoch of the grant of ``rid`` made here, granted or arriving; None if there is none."""
        inc = self.incoming.get(rid)
        if inc is not None:
            return inc.epoch
        grant = self.grants.get(rid)
        return None if grant is None else grant.epoch

    def _is_stale(self, what: str, rid: str, epoch: int) -> bool:
        """Whether ``what`` of ``rid``'s grant ``epoch`` belongs to another grant than the one live here (one
        given up, whose parts were still in flight when the request was granted again): counted, then dropped."""
        live = self._epoch_of(rid)
        if live is None or live == epoch:
            return False
        self.stale += 1
        log.info("dropped %s of %s for grant epoch %d; its grant here is epoch %d (%d stale so far)", what, rid, epoch,
                 live, self.stale)
        return True

    def _on_layer(self, peer: bytes, msg: KVLayers, payload: list, bulk: bool = False) -> None:
        """``bulk``: it came on the bulk socket, from whoever holds its grant's key (the MAC, checked before
        the frame lands, says who), not from the grant's connection."""
        rid = msg.request_id
        if self._is_stale("a KV part" if msg.is_part else "KV layers", rid, msg.epoch):
            return
        if msg.is_part:
            inc = self._part_of(rid, msg.requester)
        else:
            inc = self.incoming.get(rid)
            if inc is None and rid in self.grants:
                inc = self._open(self.grants[rid].peer if bulk else peer, rid, Frames.name)
        if inc is None or (inc.peer != peer and not msg.is_part and not bulk) or (bulk and inc.transport != Frames.name):
            return  # the rest of a transfer already failed or superseded; its sender got the nack
        self._count_from(peer, sum(f.buffer.nbytes for f in payload))
        try:
            inc.receiver.add(msg, [f.buffer for f in payload])
        except ValueError as exc:
            self._abort_incoming(rid, str(exc))
            return
        # a transfer fails for no progress, not for length: layers streamed during a slow forward come
        # over as long a time as that forward takes
        inc.deadline = time.monotonic() + inc.ttl_s

    def _count_from(self, peer: bytes, nbytes: int) -> None:
        self.kv_bytes_by_sender[peer] = self.kv_bytes_by_sender.pop(peer, 0) + nbytes  # most recent last
        if len(self.kv_bytes_by_sender) > MAX_SENDERS_COUNTED:  # peers that reconnect come back under new ids
            del self.kv_bytes_by_sender[next(iter(self.kv_bytes_by_sender))]

    def _part_of(self, rid: str, requester: str) -> Incoming | None:
        """The transfer a rank's part belongs to: the grant's (opened by the first part), its asker the part's
        requester; None for a part of a transfer that failed, was superseded, or is not its requester's."""
        inc = self.incoming.get(rid)
        if inc is not None:
            return inc if inc.requester == requester and inc.transport == RankParts.name else None
        grant = self.grants.get(rid)
        if grant is None or grant.requester != requester:
            return None
        return self._open(grant.peer, rid, RankParts.name)  # replies go to the grant's asker, rank 0

    def _on_header(self, peer: bytes, header: KVHeader, payload: list) -> None:
        rid = header.request_id
        if self._is_stale("a KV header", rid, header.epoch):
            # the nack names the header's grant: the asker's transfer of the live one does not take it for its own
            return self._nack(peer, rid, "a header of a grant given up: the request was granted again", header.epoch)
        inc = self.incoming.get(rid)
        if inc is None or inc.peer != peer or inc.header is not None:
            grant = self.grants.get(rid)
            if grant is None:
                return self._nack(peer, rid, "no grant for this request (expired or never asked)", header.epoch)
            if header.block_ids != grant.block_ids or header.model != grant.model:
                # a stale sender of a superseded grant: refuse it without touching the live grant
                return self._nack(peer, rid, "KV addressed to blocks that were not granted", header.epoch)
            inc = self._open(peer, rid, header.transport)
            if inc is None:
                return
        try:
            check_header(header, payload, inc, self.core_for(inc.model).kv)
        except ValueError as exc:
            return self._abort_incoming(rid, str(exc))
        inc.header = header  # _advance lands it once all its KV is written

    def _on_cancel(self, peer: bytes, msg: HandoffCancel) -> None:
        rid = msg.request_id
        if msg.epoch and self._is_stale("a cancel", rid, msg.epoch):
            return
        inc, grant = self.incoming.get(rid), self.grants.get(rid)
        if inc is not None and inc.peer == peer:
            inc = self.incoming.pop(rid)
            inc.receiver.abandon()
            self.core_for(inc.model).kv.free(rid)
        elif grant is not None and grant.peer == peer:
            self.book.release(rid)
        else:  # request ids are no secret: only the asker a grant was made to may give it up
            log.debug("ignored a cancel of %s from a peer holding no grant of it", rid)
            return
        log.debug("handoff of %s cancelled by its sender: %s", rid, msg.reason)

    def _advance(self, admit) -> None:
        for rid, inc in list(self.incoming.items()):
            error = inc.receiver.error()
            if error is not None:
                self._abort_incoming(rid, str(error), worker_down=isinstance(error, WorkerDown))
            elif inc.receiver.complete and inc.header is not None:
                inc.receiver.finish()
                del self.incoming[rid]
                self._land(inc.peer, inc.header, admit)

    def _land(self, peer: bytes, header: KVHeader, admit) -> None:
        """The KV sits checked in the granted blocks: join the batch and ack."""
        self.bytes_received += header.nbytes
        try:
            admit(header)
        except ValueError as exc:  # the request itself is invalid here (e.g. a smaller context)
            self.core_for(header.model).kv.free(header.request_id)
            return self._nack(peer, header.request_id, str(exc), header.epoch)
        self._reply(peer, HandoffAck(request_id=header.request_id, ok=True, epoch=header.epoch))

    def _abort_incoming(self, rid: str, reason: str, worker_down: bool = False) -> None:
        inc = self.incoming.pop(rid)
        inc.receiver.abandon()  # no write may still be landing when the blocks go back
        self.core_for(inc.model).kv.free(rid)
        log.warning("rejected KV for %s: %s", rid, reason)
        self._nack(inc.peer, rid, reason, inc.epoch, worker_down)

    def _expire(self) -> None:
        self.book.expire()
        now = time.monotonic()
        for rid, inc in [(r, inc) for r, inc in self.incoming.items() if inc.deadline < now]:
            if self.book.waited_on(inc.requester, inc.since, now):
                inc.deadline = now + inc.ttl_s
                continue
            self._abort_incoming(rid, f"KV layers stalled: nothing more arrived within {inc.ttl_s}s")

    def _nack(self, peer: bytes, rid: str, reason: str, epoch: int, worker_down: bool = False) -> None:
        self._reply(peer, HandoffAck(request_id=rid, ok=False, reason=reason, worker_down=worker_down, epoch=epoch))

    def _reply(self, peer: bytes, msg) -> None:
        if not self.socket.reply(peer, msg):
            log.warning("could not reply to a prefill worker (its queue is full)")
