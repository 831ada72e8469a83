"""Issue #26's pathology in the policy (shared/worker/eviction.py; its simulator's run is
tests/e2e/test_eviction_sim.py): under a Zipf mix the third most requested model was evicted while a model in less demand stayed, because an
idle model went first whatever its demand and every rate starts at 0. Simulated time only: no wall clock."""

import dataclasses

from kvrelay.shared.worker.eviction import (
    UNSEEN_S,
    Candidate,
    Incoming,
    choose_victims,
    min_residency_s,
    waiting_demand,
)

GB = 1 << 30
OLD = 3600.0
RELOAD = 6.0


def cand(name: str, demand: float, *, idle: bool = False, resident_s: float = OLD, idle_s: float = 0.0) -> Candidate:
    return Candidate(instance=name, weight_bytes=GB, kv_bytes=0, reload_s=RELOAD, demand=demand,
                     resident_s=resident_s, idle=idle, idle_s=idle_s)


def victim(cands: list[Candidate], load: Incoming) -> str | None:
    chosen = choose_victims(cands, GB, 0, load)
    return None if chosen is None else chosen[0].instance


def test_an_idle_model_in_demand_is_not_evicted_before_a_busy_one_in_less():
    hot, third = cand("0", 3.0, idle=True, idle_s=4.0), cand("2", 1.0, idle=True, idle_s=1.5)
    load = Incoming(demand=0.5, waiting=3)
    assert victim([hot, third, cand("3", 0.4)], load) == "3"  # busy, past its residency, in less demand
    # an idle one asked for less than once a reload still goes first: sparse traffic loads as it did
    assert victim([hot, third, cand("3", 0.4), cand("9", 0.1, idle=True, idle_s=30.0)], load) == "9"
    # the busy one in more demand than the load: the load waits (model 2, idle for a moment, stays) ...
    assert victim([hot, third, cand("3", 0.8)], load) is None
    # ... until it has waited a minimum residency: then it takes the cheapest slot, still not model 2's
    patient = Incoming(demand=0.5, waiting=9, waited_s=min_residency_s(RELOAD))
    assert victim([hot, third, cand("3", 0.8)], patient) == "3"


def test_a_starving_load_waits_for_the_cheapest_slot_rather_than_take_a_dearer_one():
    just_loaded = cand("5", 0.3, resident_s=min_residency_s(RELOAD) / 2)  # busy: the tail's last turn
    others = [cand("0", 3.0, idle=True, idle_s=4.0), cand("2", 1.0, idle=True, idle_s=1.5), cand("3", 0.8)]
    patient = Incoming(demand=0.5, waiting=9, waited_s=2 * min_residency_s(RELOAD))
    assert victim([*others, just_loaded], patient) is None
    assert victim([*others, cand("5", 0.3)], patient) == "5"  # once its residency is over


def test_rates_that_have_not_seen_their_traffic_evict_nothing():
    # the run's first second: the preloaded models' rates are 0 (model 2 not asked yet), a tail model asked
    # once or three times
    preloaded = [cand(str(i), 0.0, idle=i == 2, resident_s=1.2, idle_s=1.2 if i == 2 else 0.0) for i in range(4)]
    assert victim(preloaded, Incoming(demand=waiting_demand(1), waiting=1)) is None
    assert victim(preloaded, Incoming(demand=waiting_demand(3), waiting=3)) is None
    seen = [dataclasses.replace(c, resident_s=UNSEEN_S) for c in preloaded]  # a half-life on, still not asked
    assert victim(seen, Incoming(demand=waiting_demand(3), waiting=3)) == "2"
