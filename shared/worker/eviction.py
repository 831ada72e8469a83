"""Which hosted models a load evicts: by demand × reload cost, not only by idleness (issue #26).

Demand is each instance's exponentially decayed request-arrival rate (``DemandRate``, requests per second,
half-life ``DEMAND_HALF_LIFE_S``): the worker notes an arrival where it admits a job or a handoff for the
instance. A load's own demand is the rate the worker remembers for that instance from when it last held
it, plus the requests waiting for this load now (``ControlCommand.waiting``, which only the gateway can
count: a lazy load's requests wait on the gateway and are not queued yet), each counted as an arrival
just now. So both sides are in the same unit and a load nobody waits for has only its history.

The rule (``choose_victims``, a pure function; shared/worker/model_host.py applies it):
  * A pinned instance, or one not "ready" (loading, draining), is never a victim.
  * Idle instances (nothing queued or in flight for IDLE_GRACE_S) come first: evicting them loses no
    request, as before. Among the candidates the lowest demand × reload cost goes first (what evicting
    it costs: reloads per second its demand would bring back, times their seconds; among equals the
    longest idle per reload second), the instances the other role evicted for this load (``prefer``)
    before all others.
  * A busy instance may be evicted only for a load needed now (``waiting`` > 0) whose demand is strictly
    higher than its own. It is drained, not dropped: its stream is no longer read, what runs finishes
    (bounded by the worker's --drain-timeout, else the load is refused and the instance kept), then it is unloaded; its
    queued jobs stay in Redis and its next request loads it again (gateway/control/reload_wait.py).
  * No thrash: a busy instance loaded less than ``min_residency_s(reload_s)`` ago (the worker's
    --min-residency-s, MIN_RESIDENCY_S by default, at least RESIDENCY_RELOADS reloads) is evicted only for a load of more than THRASH_MARGIN times its
    demand; of equal or lower demand, never. The bound keeps two models of similar demand that take
    turns on one slot from spending more than 1/RESIDENCY_RELOADS of their time reloading, and is long
    enough for the decayed rate of a model just loaded to reflect its traffic (a half-life and more).
  * When even every eligible candidate would not free enough, nothing is evicted and the load is refused.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvrelay.shared.config.worker import MIN_RESIDENCY_S

DEMAND_HALF_LIFE_S = 10.0  # long enough to see a Zipf tail's steady rate, short enough to follow a shift
RESIDENCY_RELOADS = 5
THRASH_MARGIN = 2.0
# A load requests wait for, with no room yet, waits for some before it is refused: a busy model passing its
# minimum residency and then its demand falling under the load's, or an idle one's queue emptying. So twice the
# longest residency a hosted model may keep against it (as long again for the demands to cross), never less
# than ROOM_WAIT_MIN_S (the default residency's twice).
ROOM_WAIT_RESIDENCIES = 2.0
ROOM_WAIT_MIN_S = 30.0

_DECAY = math.log(2) / DEMAND_HALF_LIFE_S


class DemandRate:
    """Arrivals per second, exponentially decayed: each arrival adds ``_DECAY``, the sum halves every
    DEMAND_HALF_LIFE_S (a steady rate r reads r)."""

    def __init__(self) -> None:
        self._value = 0.0
        self._at = 0.0

    def note(self, now: float, n: float = 1.0) -> None:
        self._value = self.rate(now) + n * _DECAY
        self._at = now

    def rate(self, now: float) -> float:
        return self._value * math.exp(-_DECAY * max(0.0, now - self._at)) if self._value else 0.0


def waiting_demand(waiting: int) -> float:
    """What ``waiting`` requests that arrived just now add to a rate."""
    return waiting * _DECAY


def min_residency_s(reload_s: float, floor_s: float = MIN_RESIDENCY_S) -> float:
    return max(floor_s, RESIDENCY_RELOADS * reload_s)


def room_wait_s(reloads_s: Iterable[float], floor_s: float = MIN_RESIDENCY_S) -> float:
    """How long a load requests wait for may wait for room, the hosted models reloading in ``reloads_s``
    seconds each and ``floor_s`` the worker's --min-residency-s."""
    longest = max((min_residency_s(r, floor_s) for r in reloads_s), default=floor_s)
    return max(ROOM_WAIT_MIN_S, ROOM_WAIT_RESIDENCIES * longest)


@dataclass(frozen=True)
class Candidate:
    instance: str
    weight_bytes: int  # what its unload frees of the weights budget
    kv_bytes: int  # and of the KV pool
    reload_s: float
    demand: float  # requests per second, decayed
    resident_s: float  # since its load finished
    idle: bool  # nothing queued or in flight for a while: evicting it loses no request
    idle_s: float = 0.0  # since it was last used: among equal costs the longest idle per reload second first
    pinned: bool = False
    ready: bool = True
    preferred: bool = False  # the other role evicted it for this load


@dataclass(frozen=True)
class Incoming:
    demand: float  # requests per second, the waiting ones included
    waiting: int  # requests waiting for this load now


def eligible(c: Candidate, load: Incoming, residency_s: float = MIN_RESIDENCY_S) -> bool:
    if c.pinned or not c.ready:
        return False
    if c.idle:
        return True
    if load.waiting <= 0 or not c.demand < load.demand:
        return False
    return c.resident_s >= min_residency_s(c.reload_s, residency_s) or load.demand > THRASH_MARGIN * c.demand


def cost(c: Candidate) -> float:
    return c.demand * max(c.reload_s, 0.1)


def choose_victims(candidates: list[Candidate], need_weights: int, need_kv: int, load: Incoming,
                   residency_s: float = MIN_RESIDENCY_S) -> list[Candidate] | None:
    """The instances to evict so that ``need_weights`` and ``need_kv`` bytes are freed, cheapest first;
    [] when nothing is needed, None when even every eligible one would not free enough. ``residency_s``: the
    shortest minimum residency (--min-residency-s)."""
    if need_weights <= 0 and need_kv <= 0:
        return []
    order = sorted((c for c in candidates if eligible(c, load, residency_s)),
                   key=lambda c: (not c.preferred, not c.idle, cost(c), -c.idle_s / max(c.reload_s, 0.1)))
    chosen, freed_w, freed_kv = [], 0, 0
    for c in order:
        if freed_w >= need_weights and freed_kv >= need_kv:
            break
        chosen.append(c)
        freed_w += c.weight_bytes
        freed_kv += c.kv_bytes
    if freed_w < need_weights or freed_kv < need_kv:
        return None
    return chosen
