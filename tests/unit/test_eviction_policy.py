"""The demand-aware eviction policy as a pure function (shared/worker/eviction.py): victim order by demand ×
reload cost, pinned never, minimum residency, a busy low-demand model evicted for a waiting high-demand
load, nothing evicted when the load's demand is lower; and the decayed rate it reads."""

from kvrelay.shared.worker.eviction import (
    DEMAND_HALF_LIFE_S,
    UNSEEN_S,
    Candidate,
    DemandRate,
    Incoming,
    choose_victims,
    min_residency_s,
    room_wait_s,
)

GB = 1 << 30
OLD = 3600.0  # resident long past any minimum residency


def cand(name: str, demand: float, *, idle: bool = False, reload_s: float = 1.0, resident_s: float = OLD,
         **kw) -> Candidate:
    return Candidate(instance=name, weight_bytes=GB, kv_bytes=0, reload_s=reload_s, demand=demand,
                     resident_s=resident_s, idle=idle, **kw)


def names(chosen) -> list[str] | None:
    return None if chosen is None else [c.instance for c in chosen]


def test_victims_go_by_demand_times_reload_cost():
    load = Incoming(demand=10.0, waiting=3)
    cands = [cand("hot", 4.0, reload_s=1.0), cand("slow-to-reload", 1.0, reload_s=5.0),  # costs 4 and 5
             cand("cheap", 1.0, reload_s=2.0)]  # cost 2
    assert names(choose_victims(cands, GB, 0, load)) == ["cheap"]
    assert names(choose_victims(cands, 2 * GB, 0, load)) == ["cheap", "hot"]
    assert names(choose_victims(cands, 3 * GB, 0, load)) == ["cheap", "hot", "slow-to-reload"]


def test_idle_models_go_before_busy_ones_only_at_equal_cost_and_nothing_is_evicted_when_nothing_is_needed():
    load = Incoming(demand=10.0, waiting=1)
    assert names(choose_victims([cand("busy", 0.5), cand("idle", 0.5, idle=True)], GB, 0, load)) == ["idle"]
    cands = [cand("busy-cold", 0.1), cand("idle-warm", 2.0, idle=True)]  # idleness is no licence: cost decides
    assert names(choose_victims(cands, GB, 0, load)) == ["busy-cold"]
    assert choose_victims(cands, 0, 0, load) == []


def test_pinned_and_not_ready_models_are_never_evicted():
    load = Incoming(demand=100.0, waiting=10)
    cands = [cand("pinned", 0.0, idle=True, pinned=True), cand("draining", 0.0, idle=True, ready=False)]
    assert choose_victims(cands, GB, 0, load) is None
    assert names(choose_victims([*cands, cand("other", 5.0)], GB, 0, load)) == ["other"]


def test_a_busy_low_demand_model_is_evicted_for_a_waiting_high_demand_load():
    assert names(choose_victims([cand("tail", 0.5)], GB, 0, Incoming(demand=3.0, waiting=2))) == ["tail"]


def test_nothing_busy_is_evicted_for_a_load_of_lower_or_equal_demand_or_one_nobody_waits_for():
    busy = [cand("a", 2.0), cand("b", 3.0)]
    assert choose_victims(busy, GB, 0, Incoming(demand=1.0, waiting=4)) is None  # lower than both
    assert choose_victims(busy, GB, 0, Incoming(demand=2.0, waiting=4)) is None  # equal: no thrash
    assert choose_victims(busy, GB, 0, Incoming(demand=50.0, waiting=0)) is None  # not needed now
    assert choose_victims(busy, 3 * GB, 0, Incoming(demand=50.0, waiting=1)) is None  # not enough even so


def test_minimum_residency_protects_a_model_just_loaded_unless_the_load_is_in_far_higher_demand():
    young = (UNSEEN_S + min_residency_s(1.0)) / 2  # its rate has seen a half-life of its traffic, no more
    assert min_residency_s(1.0) >= DEMAND_HALF_LIFE_S and min_residency_s(10.0) >= 50.0
    just_loaded = [cand("new", 1.0, resident_s=young)]
    assert choose_victims(just_loaded, GB, 0, Incoming(demand=1.5, waiting=1)) is None
    assert names(choose_victims([cand("new", 1.0)], GB, 0, Incoming(demand=1.5, waiting=1))) == ["new"]  # once old
    assert names(choose_victims(just_loaded, GB, 0, Incoming(demand=5.0, waiting=1))) == ["new"]
    unseen = [cand("new", 1.0, resident_s=UNSEEN_S / 2)]  # before a half-life: no demand evicts it
    assert choose_victims(unseen, GB, 0, Incoming(demand=50.0, waiting=9)) is None


def test_the_other_roles_victims_come_first():
    cands = [cand("a", 0.0, idle=True), cand("b", 1.0, idle=True, preferred=True)]
    assert names(choose_victims(cands, GB, 0, Incoming(demand=0.0, waiting=0))) == ["b"]


def test_kv_bytes_count_too():
    cands = [Candidate("a", 0, 10, 1.0, 0.0, OLD, True), Candidate("b", 0, 10, 1.0, 0.1, OLD, True)]
    assert names(choose_victims(cands, 0, 15, Incoming(0.0, 0))) == ["a", "b"]


def test_the_decayed_rate_reads_a_steady_rate_and_halves_every_half_life():
    r = DemandRate()
    assert r.rate(0.0) == 0.0
    for k in range(2000):  # 4 arrivals a second for 500 s
        r.note(k * 0.25)
    assert abs(r.rate(500.0) - 4.0) < 0.2
    assert abs(r.rate(500.0 + DEMAND_HALF_LIFE_S) - r.rate(500.0) / 2) < 1e-6


def test_the_minimum_residency_is_the_workers_to_set():
    just_loaded = [cand("new", 1.0, resident_s=5.0)]
    load = Incoming(demand=1.5, waiting=1)  # under THRASH_MARGIN times its demand: residency decides
    assert choose_victims(just_loaded, GB, 0, load) is None
    assert names(choose_victims(just_loaded, GB, 0, load, residency_s=2.0)) == ["new"]
    slow_to_reload = [cand("new", 1.0, resident_s=5.0, reload_s=2.0)]  # still at least RESIDENCY_RELOADS reloads
    assert choose_victims(slow_to_reload, GB, 0, load, residency_s=2.0) is None


def test_a_load_waits_for_room_twice_the_longest_residency_a_hosted_model_may_keep():
    assert room_wait_s([], 15.0) == room_wait_s([0.5, 1.0], 15.0) == 30.0  # the default: 2 x 15 s
    assert room_wait_s([0.5], 60.0) == 120.0  # --min-residency-s 60
    assert room_wait_s([0.5, 20.0], 15.0) == 200.0  # a model reloading in 20 s keeps its place 100 s
    assert room_wait_s([0.5], 0.0) == 30.0  # never less: a busy model's queue may empty meanwhile
