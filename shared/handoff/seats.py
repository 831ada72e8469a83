"""A decode worker's seats for handed-off requests (the messages that move them are receiver.py's): the grants
made (grants.py), each of a request the decode role admitted (``reserve``), and the transfers arriving into them
(incoming.py), by request id. A request id granted again supersedes what was held for it; what comes for an
earlier grant of it is told apart by its epoch and dropped (``stale``); only the peer a grant was made to may
give it up (HandoffCancel). A grant whose KV never comes expires (grants.py); a transfer that makes no progress
for its TTL is freed and nacked. An ask whose prompt prefix a transfer in flight here brings is held until that
one's KV lands, then granted past the blocks it brought (held_asks.py)."""

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.grants import Busy, Grant, GrantBook, OverQuota, Reservation
from kvrelay.shared.handoff.held_asks import HeldAsks
from kvrelay.shared.handoff.inbox_socket import InboxSocket
from kvrelay.shared.handoff.incoming import Incoming, receiver_for
from kvrelay.shared.handoff.rank_parts import RankParts
from kvrelay.shared.handoff.transports import default_transports
from kvrelay.shared.wire.handoff import MAX_ASKS, HandoffAck, HandoffCancel, HandoffGrant, HandoffGrants, HandoffRequest

log = logging.getLogger(__name__)


class Seats(ABC):
    def __init__(self, socket: InboxSocket, core_for, grant_ttl_s: float, transports: list[Transport] | None,
                 asker_alive: Callable[[str], bool] | None, frames_addrs: list[str]):
        self.socket, self.core_for = socket, core_for
        self.transports = default_transports() if transports is None else transports
        self._by_name = {t.name: t for t in self.transports}
        # a sharded prefill worker's ranks send their parts themselves: taken whatever the transports chosen
        self._by_name.setdefault(RankParts.name, RankParts())
        self.book = GrantBook(core_for, grant_ttl_s, self.transports, asker_alive, frames_addrs)
        self.incoming: dict[str, Incoming] = {}
        self.held = HeldAsks(grant_ttl_s)  # asks waiting for a sibling's KV in flight here (held_asks.py)
        self.stale = 0  # KV, headers and cancels of an earlier grant of a request id granted again, dropped

    @abstractmethod
    def reserve(self, req: HandoffRequest, pending: int, from_peer: int) -> list[int] | Reservation | str:
        """The decode role's admission: the blocks allocated for ``req`` (a ``Reservation`` when some already hold
        its prompt's leading KV here), or why not (a ``Busy`` reason when
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

    def tenant_blocks(self, model: str, tenant: str) -> int:
        """Blocks of ``model`` granted here to ``tenant``'s requests, or holding their arriving KV."""
        held = [*self.grants.values(), *self.incoming.values()]
        # reused blocks count too: once the request runs, the engine counts every block it holds
        return sum(len(h.block_ids) + len(h.reused) for h in held if h.model == model and h.tenant == tenant)

    def has_model(self, model: str) -> bool:
        return self.book.has_model(model) or any(i.model == model for i in self.incoming.values())

    def forget_model(self, model: str) -> None:
        for transport in self.transports:
            transport.forget(model)

    def _answer(self, peer: bytes, req: HandoffRequest) -> HandoffGrant | None:
        """The answer to an ask now, or None when it is held for a sibling's KV in flight here (answered later, by
        ``_answer_held``)."""
        if self.held.asked_again(req.request_id):  # never held twice: a held ask is answered within one bound
            return self._grant(peer, req)
        core = self.core_for(req.model) if req.block_hashes else None
        if core is not None and core.kv.reuses_prefix and self.held.hold(
                peer, req, self._in_flight(req.model), lambda: core.kv.cached_prefix(req.num_tokens, req.block_hashes)):
            log.debug("held the ask for %s until a sibling's KV lands here", req.request_id)
            return None
        return self._grant(peer, req)

    def _in_flight(self, model: str) -> list[tuple[str, list[int]]]:
        """``model``'s transfers granted or arriving here: (request id, the hashes of the blocks cached once it lands)."""
        return [(rid, h.block_hashes) for held in (self.grants, self.incoming) for rid, h in held.items()
                if h.model == model and h.block_hashes]

    def _answer_held(self) -> None:
        """Grant (or refuse) the held asks whose wait is over, one reply per asker."""
        if not self.held:
            return
        replies: dict[bytes, list[HandoffGrant]] = {}

        def cached(req: HandoffRequest) -> int:
            core = self.core_for(req.model)
            return 0 if core is None else core.kv.cached_prefix(req.num_tokens, req.block_hashes)

        for ask in self.held.due(self._in_flight, cached):
            replies.setdefault(ask.peer, []).append(self._grant(ask.peer, ask.req))
        for peer, grants in replies.items():
            for i in range(0, len(grants), MAX_ASKS):
                batch = grants[i:i + MAX_ASKS]
                self._reply(peer, batch[0] if len(batch) == 1 else HandoffGrants(batch))

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
                                over_quota=isinstance(blocks, OverQuota), ask=req.ask)
        return self.book.add(peer, req, blocks if isinstance(blocks, Reservation) else Reservation(blocks))

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

    def _on_cancel(self, peer: bytes, msg: HandoffCancel) -> None:
        rid = msg.request_id
        if msg.epoch and self._is_stale("a cancel", rid, msg.epoch):
            return
        inc, grant = self.incoming.get(rid), self.grants.get(rid)
        if not msg.epoch and self.held.cancel(peer, rid):  # naming no grant: its ask, held here
            log.debug("held ask of %s cancelled by its sender: %s", rid, msg.reason)
            return
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
