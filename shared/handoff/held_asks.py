"""A decode worker's asks held for a sibling's KV: an ask whose prompt shares leading blocks with a transfer granted
or arriving here, whose KV has not landed yet, waits for that transfer instead of being granted at once, then is
granted past the blocks it brought (HandoffGrant.cached_blocks) and sent only the rest.

Why: requests sharing a prompt prefix (an n > 1 request's choices, routed together; concurrent chats with one system
prompt) ask here close together. Reuse finds only blocks the engine has cached, which a handed-off prompt's are once
it is admitted (its KV landed): an ask arriving while the first one's KV is still on its way would be granted every
block and sent the whole prompt again. This is the decode side's half of what prompt sharing does on the prefill side
(shared/engine/prompt_sharing.py: a sibling waits for the leader's prefill, then takes its blocks from the cache).

One state per held ask, as SGLang's disaggregation keeps a poll state per transfer:

    ask  --an in-flight transfer here brings more of its prefix than the cache holds now-->  HELD on that transfer
    HELD --its transfer left the flight (landed, failed, cancelled, expired)-->
             HELD on another in-flight transfer that brings more than is cached now (within the same wait bound),
             else READY (the blocks it waited for are cached: granted reusing them)
             or UNBLOCKED (they are not: the transfer failed; granted on what is cached, in full if nothing is)
    HELD --``wait_s`` passed since it came-->  UNBLOCKED
    HELD --its asker cancelled it (HandoffCancel naming no grant) or asked again-->  DROPPED (asked again: answered
             at once, never held twice)

Nothing is reserved for a held ask (no blocks, no seat), so it blocks nobody: every other ask is granted past it, and
when it is answered the decode role admits it as any ask (it may be refused then, e.g. the batch filled meanwhile).
No wait is unbounded: ``wait_s`` is a share of the grant TTL, well inside the asker's own wait for an answer (the
handoff timeout), so an asker never gives up on a held ask, and a grant made after it still leaves the asker the
first half of the grant's life in which early grants and direct writes must be used (sender.py). Nothing here
blocks: holding, reviewing and answering are bookkeeping in the decode loop's poll.
"""

import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvrelay.shared.wire.handoff import HandoffRequest

# of the grant TTL (the handoff timeout), how long an ask may be held: the asker waits one handoff timeout for an
# answer, and must use an early or direct-write grant within half the TTL of asking
HOLD_SHARE_OF_TTL = 0.25


class HoldState(enum.Enum):
    HELD = "held"  # waiting for ``provider``'s KV to land
    READY = "ready"  # the provider's blocks are cached: answer now, reusing them
    UNBLOCKED = "unblocked"  # the provider failed, or the wait bound passed: answer now on what is cached
    DROPPED = "dropped"  # its asker gave it up or asked again: nothing to answer for it here


@dataclass
class HeldAsk:
    peer: bytes  # the asker's ZMQ identity
    req: HandoffRequest
    since: float  # monotonic time it was held
    until: float  # monotonic time past which it is held no longer
    provider: str  # the request id of the in-flight transfer whose KV it waits for
    waits_for: int  # how many of its leading blocks that transfer brings
    state: HoldState = HoldState.HELD


def shared_blocks(a: list[int], b: list[int]) -> int:
    """How many leading hashes ``a`` and ``b`` have in common. Each hash of a chain covers its parent (block_hash.py),
    so equal at i means equal before i: a bisection finds the end of the common run."""
    lo, hi = 0, min(len(a), len(b))  # the common run is at least lo long, at most hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def reusable(req: HandoffRequest) -> int:
    """The most of ``req``'s leading blocks a grant can reuse: its offered hashes, one block always left to send."""
    return min(len(req.block_hashes), (req.num_tokens - 1) // req.block_size)


def best_provider(req: HandoffRequest, in_flight: Iterable[tuple[str, list[int]]], cached: int) -> tuple[str, int] | None:
    """Among ``in_flight`` transfers of ``req``'s model here (request id, the hashes its ask offered, whose blocks
    are cached once it lands), the one bringing the most of ``req``'s prefix, and how much, if more than the
    ``cached`` blocks the cache holds now; else None."""
    most, best = min(cached, reusable(req)), None
    for rid, hashes in in_flight:
        if rid != req.request_id and hashes and req.block_hashes and hashes[0] == req.block_hashes[0]:
            n = min(shared_blocks(req.block_hashes, hashes), reusable(req))
            if n > most:
                most, best = n, rid
    return None if best is None else (best, most)


class HeldAsks:
    def __init__(self, grant_ttl_s: float):
        self.wait_s = grant_ttl_s * HOLD_SHARE_OF_TTL
        self.asks: dict[str, HeldAsk] = {}  # by request id, in the order they came
        self.outcomes: Counter[HoldState] = Counter()  # how held asks ended (HELD: how many were held)
        # told of each held ask as it ends: its model, how it ended (a HoldState's value) and how long it was held;
        # the decode worker's Prometheus series (shared/worker/held_ask_metrics.py)
        self.on_end: Callable[[str, str, float], None] = lambda model, outcome, held_s: None

    def __bool__(self) -> bool:
        return bool(self.asks)

    def hold(self, peer: bytes, req: HandoffRequest, in_flight: list[tuple[str, list[int]]],
             cached: Callable[[], int]) -> bool:
        """Hold ``req`` if an in-flight transfer brings more of its prefix than ``cached()`` blocks, which the cache
        holds now (counted only when some transfer starts as ``req`` does); whether it was held."""
        first = req.block_hashes[:1]
        if not first or not any(hashes[:1] == first for _, hashes in in_flight):
            return False
        found = best_provider(req, in_flight, cached())
        if found is None:
            return False
        now = time.monotonic()
        self.asks[req.request_id] = HeldAsk(peer, req, now, now + self.wait_s, *found)
        self.outcomes[HoldState.HELD] += 1
        return True

    def asked_again(self, request_id: str) -> bool:
        """An ask for ``request_id`` came while one was held: whether one was (it is dropped: the new one is answered
        at once, so no request waits past one bound however often it asks)."""
        ask = self.asks.get(request_id)
        if ask is not None:
            self._end(ask, HoldState.DROPPED)
        return ask is not None

    def cancel(self, peer: bytes, request_id: str) -> bool:
        """The asker at ``peer`` gave up its ask for ``request_id``: whether one was held (and is dropped)."""
        ask = self.asks.get(request_id)
        if ask is None or ask.peer != peer:
            return False
        self._end(ask, HoldState.DROPPED)
        return True

    def due(self, in_flight: Callable[[str], list[tuple[str, list[int]]]],
            cached: Callable[[HandoffRequest], int]) -> Iterator[HeldAsk]:
        """The held asks to answer now (READY or UNBLOCKED), oldest first, each reviewed only once the one before it
        was answered: a grant made for one is a transfer in flight that a later one may wait for.
        ``in_flight(model)``: that model's transfers granted or arriving here (request id, offered hashes);
        ``cached(req)``: how many of ``req``'s leading blocks the cache holds now."""
        now = time.monotonic()
        for ask in list(self.asks.values()):
            if ask.state is not HoldState.HELD:
                continue
            flying = in_flight(ask.req.model)
            if now <= ask.until and any(rid == ask.provider for rid, _ in flying):
                continue
            have = cached(ask.req)
            if now <= ask.until and (found := best_provider(ask.req, flying, have)) is not None:
                ask.provider, ask.waits_for = found  # its transfer failed; another sibling's is on its way
                continue
            self._end(ask, HoldState.READY if have >= ask.waits_for else HoldState.UNBLOCKED)
            yield ask

    def _end(self, ask: HeldAsk, state: HoldState) -> None:
        ask.state = state
        self.outcomes[state] += 1
        del self.asks[ask.req.request_id]
        self.on_end(ask.req.model, state.value, time.monotonic() - ask.since)
