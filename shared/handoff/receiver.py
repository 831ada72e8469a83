"""The decode side's handoff mechanics: one socket's loop over grants (grants.py) and the transfers arriving
into them (incoming.py), the ack that lets the prefill side XACK the job. What is held for which request, and
who may give it up, is seats.py's; which requests get blocks is the decode role's (``reserve``,
decode_worker/receiver.py).

Per request: HandoffRequest (or one of a step's HandoffRequests, answered by one HandoffGrants) -> granted
(blocks reserved, expiry armed; a direct-write offer when the asker shares our device) -> the transfer's first
KVLayers message, or a header saying the KV was written directly, opens a ``KVReceiver`` (base.py) -> the
header, which comes last and carries the first token, must match the grant and our layout -> once the receiver
is complete: admitted and acked. An ask whose prompt prefix a transfer in flight here brings is held until that
one lands (or fails, or a bound passes: held_asks.py), then granted past the blocks it brought. A bad layer, a bad header, or no progress for the grant's TTL frees the blocks
and nacks (while its asker still heartbeats, only MAX_GRANT_HOLD_S does). HandoffCancel frees a grant (or a
transfer's blocks) the sender gave up on, when it comes from the peer the grant was made to. An ask that does not
decode (a newer asker's must-understand field) is refused with the codec's line (unreadable.py); in a step of
asks, only that ask: the others are granted as ever. Every grant has its
epoch (grants.py), which its KV, header, ack and cancel carry: a request id granted again has a new one, and what
comes for the old grant is dropped (``stale``).

With bulk sockets (plain, no CURVE: ``bulk``), every grant names them and carries a fresh key, and the frames come
there, each MAC'd under its grant's key (frames.py), dealt across the sockets in any order. Anyone who reaches those
sockets can send to them, so only MAC'd frames of a frames transfer are taken from them, and a bad MAC fails the
transfer before a byte of that frame lands.
"""

import logging
import time
from collections.abc import Callable

import zmq

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.frames import Frames
from kvrelay.shared.handoff.inbox_socket import InboxSocket
from kvrelay.shared.handoff.incoming import Incoming, check_header
from kvrelay.shared.handoff.rank_parts import RankParts
from kvrelay.shared.handoff.seats import Seats
from kvrelay.shared.handoff.sharded import WorkerDown
from kvrelay.shared.handoff.spin_poll import REPLY_SPIN_S
from kvrelay.shared.handoff.unreadable import asks_one_by_one, refusal, unread_asks
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


class KVInbox(Seats):
    def __init__(self, sock: zmq.Socket, core_for, grant_ttl_s: float, transports: list[Transport] | None = None,
                 asker_alive: Callable[[str], bool] | None = None, bulk: list[tuple[zmq.Socket, str]] | None = None):
        """``core_for(model)``: the EngineCore serving that model instance here, or None; the inbox works
        on its KV only through ``core.kv`` (shared/engine/kv_connector.py). ``asker_alive(worker_id)``:
        whether that prefill worker still heartbeats; its grants and stalled transfers then outlive their
        TTL (up to MAX_GRANT_HOLD_S): it reads our replies only between its engine steps, and one step
        can be longer than the TTL. None: every grant lapses at its TTL. ``bulk``: (a plain socket, the
        address senders dial it at) for each stream of MAC'd frames; None: frames come on ``sock`` with CRCs."""
        super().__init__(InboxSocket(sock, [s for s, _ in bulk or ()]), core_for, grant_ttl_s, transports, asker_alive,
                         [a for _, a in bulk or ()])
        self.bytes_received = 0
        # KV bytes taken per sending socket: a sharded prefill worker's ranks each send from their own
        self.kv_bytes_by_sender: dict[bytes, int] = {}
        self.refused_bulk = 0  # messages on the bulk sockets that were no MAC'd frames

    def poll(self, timeout_ms: int, admit) -> int:
        """Handle every waiting message; ``admit(header)`` adds an arrived request to the batch.
        Returns the number of messages handled."""
        handled = 0
        # every transfer's receiver reads its socket in _advance (or the transfer ends): none stays ready
        self.socket.watch({s for inc in self.incoming.values() if (s := inc.receiver.wakes_on) is not None})
        # a granted transfer's KV or header is on its way (or its prompt is still being computed): spin_poll.py
        for frames, bulk in self.socket.messages(timeout_ms, REPLY_SPIN_S if self.grants or self.incoming else 0.0):
            handled += 1
            if bulk:
                self._on_bulk(frames)
            else:
                self._on_message(frames)
        self._advance(admit)
        self._expire()
        self._answer_held()  # after both: a transfer that landed or failed here is one a held ask waits for no more
        return handled

    def _on_message(self, frames: list) -> None:
        if len(frames) < 2:
            log.warning("dropped a handoff message without a body")
            return
        peer, payload = frames[0].bytes, frames[2:]
        try:
            msg = decode_any(frames[1].bytes, HandoffRequest, HandoffRequests, KVHeader, KVLayers, HandoffCancel)
        except ValueError as exc:
            if answers := asks_one_by_one(frames[1].bytes):  # a step of asks: only those unreadable are refused
                log.warning("refused %d of a step's %d handoff asks: %s",
                            sum(isinstance(a, HandoffGrant) for a in answers), len(answers), exc)
                self._reply_all(peer, [a if isinstance(a, HandoffGrant) else self._answer(peer, a) for a in answers])
                return
            # a newer asker's ask (a field it must have understood) is refused at once: no wait for a timeout there
            asks = unread_asks(frames[1].bytes)
            log.warning("%s handoff message: %s", "refused a" if asks else "dropped a malformed", exc)
            if asks:
                self._reply(peer, refusal(asks, str(exc)))
            return
        if isinstance(msg, HandoffRequest):
            self._reply_all(peer, [self._answer(peer, msg)])
        elif isinstance(msg, HandoffRequests):  # one step's asks: answered together, but for those held
            self._reply_all(peer, [self._answer(peer, req) for req in msg.requests])
        elif isinstance(msg, HandoffCancel):
            self._on_cancel(peer, msg)
        elif isinstance(msg, KVLayers):
            self._on_layer(peer, msg, payload)
        else:
            self._on_header(peer, msg, payload)

    def _reply_all(self, peer: bytes, answers: list[HandoffGrant | None]) -> None:
        """One message of the ``answers`` given now (None: an ask held, answered on its own later)."""
        given = [a for a in answers if a is not None]
        if given:
            self._reply(peer, given[0] if len(given) == 1 else HandoffGrants(given))

    def _on_bulk(self, frames: list) -> None:
        """A message on one of the plain bulk sockets, where anyone can send: a MAC'd frame goes on to be checked,
        anything else is counted and dropped (logged only at debug: no stranger fills our log)."""
        try:
            msg = decode_any(frames[1].bytes, KVLayers) if len(frames) >= 2 else None
        except ValueError:
            msg = None
        if msg is None or not msg.mac:
            self.refused_bulk += 1
            log.debug("dropped a message on a bulk socket that is no MAC'd KV frame (%d so far)", self.refused_bulk)
            return
        self._on_layer(frames[0].bytes, msg, frames[2:], bulk=True)

    def _on_layer(self, peer: bytes, msg: KVLayers, payload: list, bulk: bool = False) -> None:
        """``bulk``: it came on a bulk socket, from whoever holds its grant's key (the MAC, checked before
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
