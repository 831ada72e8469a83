"""A decode worker's grants: blocks reserved for a request's KV before it arrives, each kept for the grant's
TTL (while its asker still heartbeats, only MAX_GRANT_HOLD_S bounds it: a step of the asker's can outlast the
TTL). A grant whose KV never arrives expires and its blocks return to the pool, except that blocks offered for
direct writes stay quarantined for one more TTL: the asker writes them only within half the TTL of asking, so
by the end of the quarantine no write can still land in them. Which requests get blocks is the decode role's
(``Seats.reserve``, seats.py)."""

import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.wire.handoff import FRAME_KEY_BYTES, HandoffGrant, HandoffRequest

log = logging.getLogger(__name__)

# the longest a grant (or a transfer that stopped progressing) is kept for a live asker: past its TTL
# while its asker still heartbeats (a slow step, shared/handoff/grant_hold.py), or for an asker that says
# its steps are slow (HandoffRequest.hold_s). A grant holds a seat and blocks: this bounds what a live
# asker that forgot one can cost
MAX_GRANT_HOLD_S = 120.0


class Busy(str):
    """A refusal for lack of room now (a full batch, no free blocks): the asker keeps its KV and asks again,
    as a request waits in vLLM's queue for a seat, rather than failing."""


class OverQuota(Busy):
    """A refusal because the request's tenant holds its KV quota here (decode_worker/tenant_quota.py): the asker
    waits and asks again as for a seat, and the answer says which wait it is (HandoffGrant.over_quota)."""


@dataclass
class Reservation:
    """What the decode role reserved for an ask: ``fresh`` blocks the sender fills, after the ``reused`` ones that
    already hold the prompt's leading blocks here (HandoffGrant.cached_blocks), checked against the header's
    prompt before the request is admitted."""

    fresh: list[int]
    reused: list[int] = field(default_factory=list)


@dataclass
class Grant:
    peer: bytes  # the asker's ZMQ identity
    requester: str  # its worker id (HandoffRequest.requester), for asking whether it still lives
    model: str
    block_ids: list[int]
    num_tokens: int
    expires: float
    ttl_s: float  # its lifetime: the handoff timeout, or longer for an asker with slow steps
    since: float  # monotonic time it was granted
    epoch: int  # HandoffGrant.epoch: KV of any other grant of the request is not this one's
    offered: bool = False  # a direct-write handle went out with it
    frames_key: bytes = field(default=b"", repr=False)  # HandoffGrant.frames_key: its frames' MACs are under it
    tenant: str = ""  # HandoffRequest.tenant: whose KV quota its blocks count against
    reused: list[int] = field(default_factory=list)  # Reservation.reused: held here already, not sent
    # its ask's (HandoffRequest.block_hashes): the blocks cached here once its KV lands, which a sibling's ask may
    # wait for (held_asks.py)
    block_hashes: list[int] = field(default_factory=list, repr=False)


class GrantBook:
    """The grants whose KV has not started arriving, by request id, and the quarantined blocks."""

    def __init__(self, core_for, grant_ttl_s: float, transports: list[Transport],
                 asker_alive: Callable[[str], bool] | None, frames_addrs: list[str] | None = None):
        """``frames_addrs``: our plain bulk sockets, where each grant's frames go MAC'd under a key of its own
        (none: frames come to the grant's socket, CRC-checked)."""
        self.core_for, self.grant_ttl_s, self.transports = core_for, grant_ttl_s, transports
        self.frames_addrs = frames_addrs or []
        self.asker_alive = asker_alive
        self.grants: dict[str, Grant] = {}
        self.quarantine: list[tuple[float, str, str]] = []  # (release time, model, owner key of parked blocks)
        self._quarantined = 0
        # epochs count up from a random start: unique among this worker's grants, and unlike those of an earlier
        # run of it at the same address, whose senders may still have parts in flight
        self._epochs = itertools.count(1 + secrets.randbelow(1 << 62))

    def has_model(self, model: str) -> bool:
        return any(g.model == model for g in self.grants.values()) or any(q[1] == model for q in self.quarantine)

    def add(self, peer: bytes, req: HandoffRequest, reserved: Reservation) -> HandoffGrant:
        """Grant ``reserved`` (for ``req``) to the asker at ``peer``: it fills the fresh blocks."""
        blocks = reserved.fresh
        engine_kv = self.core_for(req.model).kv
        # a sharded cache takes frames only (sharded.py): nothing to offer for direct writes
        offer = None if engine_kv.sharded else next(
            (o for t in self.transports if (o := t.offer(req.model, engine_kv.kv_cache, req)) is not None), None)
        # the asker reads our reply only between its engine steps: a grant lives at least as long as it
        # says those take, or its KV would arrive after we had taken the blocks back
        ttl, now, epoch = max(self.grant_ttl_s, min(req.hold_s, MAX_GRANT_HOLD_S)), time.monotonic(), next(self._epochs)
        # fresh per grant: a frame MAC'd for one grant is nothing to any other, and only its asker (it
        # travels in the grant, over CURVE) can make one
        key = secrets.token_bytes(FRAME_KEY_BYTES) if self.frames_addrs else b""
        self.grants[req.request_id] = Grant(peer, req.requester, req.model, blocks, req.num_tokens, now + ttl, ttl,
                                            now, epoch, offered=offer is not None, frames_key=key, tenant=req.tenant,
                                            reused=reserved.reused, block_hashes=req.block_hashes)
        # a sharded cache whose ranks each take their own share: where the sender's ranks send each one's
        targets = engine_kv.part_targets(req.request_id, req.requester, epoch, blocks) if engine_kv.sharded else []
        return HandoffGrant(request_id=req.request_id, accepted=True, block_ids=blocks, ipc=offer, ttl_s=ttl,
                            targets=targets, epoch=epoch, frames_addr=self.frames_addrs[0] if key else "",
                            more_frames_addrs=self.frames_addrs[1:], frames_key=key,
                            ask=req.ask, cached_blocks=len(reserved.reused))

    def release(self, rid: str) -> None:
        """Give a grant's blocks back: at once, or after the quarantine when they were offered for direct writes."""
        grant = self.grants.pop(rid)
        kv = self.core_for(grant.model).kv
        kv.drop_parts(rid)  # its ranks stop expecting it before its blocks go back
        if not grant.offered:
            kv.free(rid)
            return
        # the asker may still be writing these blocks directly: park them under a private owner key
        # (the request id may be granted again at once) and free them one TTL later
        self._quarantined += 1
        key = f"ipc-quarantine\x00{self._quarantined}"
        kv.park(rid, key)
        self.quarantine.append((time.monotonic() + grant.ttl_s, grant.model, key))

    def expire(self) -> None:
        """Release the grants past their TTL whose askers are gone, and the blocks whose quarantine is over."""
        now = time.monotonic()
        for rid, g in [(r, g) for r, g in self.grants.items() if g.expires < now]:
            if self.waited_on(g.requester, g.since, now):
                g.expires = now + g.ttl_s
                continue
            log.warning("grant for %s expired without KV; freeing its blocks", rid)
            self.release(rid)
        while self.quarantine and self.quarantine[0][0] < now:
            _, model, key = self.quarantine.pop(0)
            self.core_for(model).kv.free(key)

    def waited_on(self, requester: str, since: float, now: float) -> bool:
        """A lapsed grant (or stalled transfer) whose asker lives: it is in a long step, not gone, and will
        use it or cancel it (a failed or abandoned transfer is cancelled)."""
        return (bool(requester) and self.asker_alive is not None and now - since < MAX_GRANT_HOLD_S
                and self.asker_alive(requester))
