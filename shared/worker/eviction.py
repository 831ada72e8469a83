"""Which hosted models a load evicts: by demand × reload cost, not only by idleness (issue #26).

Demand is each instance's exponentially decayed request-arrival rate (``DemandRate``, requests per second,
half-life ``DEMAND_HALF_LIFE_S``): the worker notes an arrival where it admits a job or a handoff for the
instance. A load's own demand is the rate the worker remembers for that instance from when it last held
it, plus the requests waiting for this load now (``ControlCommand.waiting``, which only the gateway can
count: a lazy load's requests wait on the gateway and are not queued yet), each counted as an arrival
just now. So both sides are in the same unit and a load nobody waits for has only its history.

The rule (``choose_victims``, a pure function; shared/worker/model_host.py applies it):
  * A pinned instance, or one not "ready" (loading, draining), is never a victim.
  * Victims go by what evicting them costs, idle or busy alike: the lowest demand × reload cost first (the
    reloads per second its demand would bring back, times their seconds); among equals an idle one (it
    frees its memory now, a busy one drains first), then the longest idle per reload second; the instances
    the other role evicted for this load (``prefer``) before all others. Idleness is no licence: a model in
    demand with nothing queued for a second is asked for again within seconds, and its reload then costs
    those requests far more than a drain would have.
  * A load nobody waits for (``waiting`` == 0: an operator's, a prewarm) may evict only idle instances,
    whatever their demand: it was asked for, and evicting an idle one loses no request.
  * A load requests wait for evicts an instance, idle or busy, only if its demand is higher than the
    instance's, or if the instance is idle and sparse: fewer than one request expected over its reload
    (``cost`` < ``SPARSE``), so evicting it costs at most one reload, and likely none soon. Never one here
    less than ``UNSEEN_S`` (a half-life; its minimum residency if shorter): its rate has not seen its
    traffic yet (every rate starts at 0, a preloaded model's too), so a burst of a few requests for another
    model must not read as more demand than a model in demand not asked in its first second. A busy victim
    is drained, not dropped: its stream is no longer read, what runs finishes (bounded by the worker's
    --drain-timeout, else the load is refused and the instance kept), then it is unloaded; its queued jobs
    stay in Redis and its next request loads it again (gateway/control/reload_wait.py).
  * No thrash: a busy instance loaded less than ``min_residency_s(reload_s)`` ago (the worker's
    --min-residency-s, MIN_RESIDENCY_S by default, at least RESIDENCY_RELOADS reloads) is evicted only for a
    load of more than THRASH_MARGIN times its demand. The bound keeps two models of similar
    demand that take turns on one slot from spending more than 1/RESIDENCY_RELOADS of their time
    reloading, and is long enough for the decayed rate of a model just loaded to reflect its traffic.
  * No starvation: a load whose oldest request has waited ``patience_s`` (the victims' minimum residency)
    takes the cheapest instances whatever the demands, once none of them is a busy one within its minimum
    residency (it waits for that one rather than take a dearer one). So the tail of a mix takes turns on
    the cheapest slot, never on the slot of a model in more demand, and a load that waits for room
    (``room_wait_s``, twice the longest residency) finds it before it is refused.
  * When even every eligible candidate would not free enough, nothing is evicted and the load is refused
    (a load requests wait for tries again until ``room_wait_s``).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvrelay.shared.config.worker import MIN_RESIDENCY_S

DEMAND_HALF_LIFE_S = 10.0  # long enough to see a Zipf tail's steady rate, short enough to follow a shift
RESIDENCY_RELOADS = 5
THRASH_MARGIN = 2.0
UNSEEN_S = DEMAND_HALF_LIFE_S  # a rate younger than this has not seen its model's traffic
SPARSE = 1.0  # requests expected over a reload, below which an idle model is cheap to evict whatever the demands
# A load requests wait for, with no room yet, waits for some before it is refused: its patience running out (a
# minimum residency) and the cheapest hosted models passing theirs, or the demands crossing. So twice the longest
# residency a hosted model may keep against it, never less than ROOM_WAIT_MIN_S (the default residency's twice).
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
    waited_s: float = 0.0  # how long the oldest of them has waited


def patience_s(c: Candidate, residency_s: float = MIN_RESIDENCY_S) -> float:
    """How long a load requests wait for waits before ``c``'s demand no longer keeps it out: as long as ``c``
    may keep its place against it once loaded, so two turns on one slot are alike."""
    return min_residency_s(c.reload_s, residency_s)


def young(c: Candidate, residency_s: float = MIN_RESIDENCY_S) -> bool:
    """Busy and loaded less than a minimum residency ago: keeps its place (no thrash)."""
    return not c.idle and c.resident_s < min_residency_s(c.reload_s, residency_s)


def eligible(c: Candidate, load: Incoming, residency_s: float = MIN_RESIDENCY_S) -> bool:
    """Whether ``load``'s demand may evict ``c`` (a load that has waited out its patience may also take
    the cheapest ones whatever their demand: ``choose_victims``)."""
    if c.pinned or not c.ready:
        return False
    if load.waiting <= 0:
        return c.idle
    residency = min_residency_s(c.reload_s, residency_s)
    if c.resident_s < min(UNSEEN_S, residency):  # its rate has not seen its traffic (a short --min-residency-s: sooner)
        return False
    if young(c, residency_s):
        return load.demand > THRASH_MARGIN * c.demand
    return load.demand > c.demand or (c.idle and cost(c) < SPARSE)


def cost(c: Candidate) -> float:
    return c.demand * max(c.reload_s, 0.1)


def choose_victims(candidates: list[Candidate], need_weights: int, need_kv: int, load: Incoming,
                   residency_s: float = MIN_RESIDENCY_S) -> list[Candidate] | None:
    """The instances to evict so that ``need_weights`` and ``need_kv`` bytes are freed, cheapest first;
    [] when nothing is needed, None when even every eligible one would not free enough. ``residency_s``: the
    shortest minimum residency (--min-residency-s)."""
    if need_weights <= 0 and need_kv <= 0:
        return []
    order = sorted((c for c in candidates if not c.pinned and c.ready),
                   key=lambda c: (not c.preferred, cost(c), not c.idle, -c.idle_s / max(c.reload_s, 0.1)))
    chosen = _enough([c for c in order if eligible(c, load, residency_s)], need_weights, need_kv)
    if chosen is not None or load.waiting <= 0:
        return chosen
    # starving: its turn on the cheapest slots, once each has kept its place a minimum residency against it
    cheapest = _enough(order, need_weights, need_kv)
    if cheapest is None or any(young(c, residency_s) or load.waited_s < patience_s(c, residency_s) for c in cheapest):
        return None
    return cheapest


def _enough(order: list[Candidate], need_weights: int, need_kv: int) -> list[Candidate] | None:
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
