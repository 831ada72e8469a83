"""Multi-tenant scheduling on the CPU with the fake runner of test_scheduler: virtual-token-counter fair
admission (a flood cannot starve a trickle, backlogged tenants get equal token shares, no banked credit,
priority first, FCFS within a tenant, identical to the plain queue with one tenant), per-tenant KV
quotas, and prefix caches that never cross tenants."""

import random
import zlib

import pytest

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.wire.block_hash import cache_namespace
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.unit.scheduler_runner import BS, EOS, FakeRunner, assert_clean


def make(fair=True, quota=None, num_blocks=256, budget=32, max_seqs=4, policy="fcfs", max_model_len=64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy,
                          tenant_fairness=fair, tenant_kv_quota=quota)
    return Scheduler(cfg, BlockManager(num_blocks, BS), max_model_len)


def rq(rid: str, tenant: str, n_prompt: int = 12, max_tokens: int = 4, priority: int = 0, salt=None, base=None):
    # distinct prompts, the same in every process (str hash() is salted): no accidental prefix hits
    base = zlib.crc32(rid.encode()) % 100_000 + 10 if base is None else base
    prompt = [base + i for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(), eos_token_id=EOS, max_tokens=max_tokens, priority=priority,
                   tenant=tenant, cache_salt=salt)


def first_scheduled_steps(s: Scheduler, arrivals: dict[int, list[Request]], max_steps: int = 2000) -> dict[str, int]:
    """Run, adding ``arrivals[step]`` before that step; the step at which each request was first scheduled."""
    runner, first, step = FakeRunner(s), {}, 0
    while step < max_steps and (s.has_unfinished() or any(k >= step for k in arrivals)):
        for r in arrivals.get(step, []):
            s.add_request(r)
        out, _ = runner.step()
        for x in out.scheduled:
            first.setdefault(x.request.request_id, step)
        step += 1
    assert not s.has_unfinished(), "did not drain"
    return first


def flood_and_trickle() -> tuple[dict[int, list[Request]], dict[str, int]]:
    arrivals = {0: [rq(f"a{i}", "a") for i in range(200)]}
    b_arrival = {}
    for k in range(10):
        step = 3 + 7 * k
        arrivals.setdefault(step, []).append(rq(f"b{k}", "b"))
        b_arrival[f"b{k}"] = step
    return arrivals, b_arrival


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_flooding_tenant_cannot_starve_a_trickle(policy):
    # A request lives about 4 steps here (a 12-token prompt in one chunk, then 3 decodes) and 4 run at
    # once, so a slot frees about every step: B must get one of the next few, not wait behind 200.
    arrivals, b_arrival = flood_and_trickle()
    s = make(policy=policy)
    first = first_scheduled_steps(s, arrivals)
    waits = {rid: first[rid] - step for rid, step in b_arrival.items()}
    print("B waits (steps), fair:", waits)
    assert max(waits.values()) <= 6
    assert_clean(s)
    # The same workload in one FCFS queue: B waits behind A's backlog. This is what the bound guards.
    arrivals, _ = flood_and_trickle()
    s = make(fair=False, policy=policy)
    first = first_scheduled_steps(s, arrivals)
    unfair = {rid: first[rid] - step for rid, step in b_arrival.items()}
    print("B waits (steps), one queue:", unfair)
    assert min(unfair.values()) > 50


def test_backlogged_tenants_get_equal_token_shares():
    s = make()
    for i in range(60):
        s.add_request(rq(f"a{i}", "a"))
    for i in range(60):
        s.add_request(rq(f"b{i}", "b"))  # queued after all of A's: FCFS would serve A first
    runner, served = FakeRunner(s), {"a": 0, "b": 0}
    max_gap = 0
    for _ in range(100):  # both stay backlogged for all of these steps
        out, _ = runner.step()
        for x in out.scheduled:
            served[x.request.tenant] += x.num_new_tokens
        max_gap = max(max_gap, abs(served["a"] - served["b"]))
    counters = s.tenant_counters
    assert counters["a"] == served["a"] and counters["b"] == served["b"]
    print("served:", served, "largest gap:", max_gap)
    # One request's worth of tokens (12 + 4) per running slot is the most admission can be ahead by.
    assert max_gap <= 4 * 16 and min(served.values()) > 400


def test_new_tenant_is_lifted_and_cannot_bank_credit():
    s = make(max_seqs=2)
    for i in range(40):
        s.add_request(rq(f"a{i}", "a"))
    runner, seen = FakeRunner(s), set()
    for _ in range(30):
        out, _ = runner.step()
        seen |= {x.request.request_id for x in out.scheduled}
    a_served = s.tenant_counters["a"]
    assert a_served > 200
    for i in range(40):
        s.add_request(rq(f"b{i}", "b"))
    assert s.tenant_counters["b"] == a_served  # lifted to the least active counter, not 0
    # Had B kept a counter of 0 it would now be admitted alone for ~a_served tokens (15 requests, some
    # 30 steps at 2 slots); lifted, the two alternate from the start.
    admitted = []
    for _ in range(12):
        out, _ = runner.step()
        admitted += [x.request.tenant for x in out.scheduled if x.request.request_id not in seen]
        seen |= {x.request.request_id for x in out.scheduled}
    print("admissions after B arrived:", admitted)
    assert admitted.count("a") >= 2 and admitted.count("b") >= 2
    runner.run(max_steps=2000)
    assert_clean(s)


def test_idle_tenants_do_not_accumulate_counters():
    s = make()
    runner = FakeRunner(s)
    for t in range(50):
        s.add_request(rq(f"r{t}", f"tenant{t}", max_tokens=1))
    runner.run()
    assert s.tenant_counters == {}  # everyone idle: nothing owed, nothing kept
    assert_clean(s)


def test_priority_first_then_counters():
    s = make(policy="priority", max_seqs=1)
    for i in range(5):
        s.add_request(rq(f"a{i}", "a", priority=0, max_tokens=1))
    s.add_request(rq("b-low", "b", priority=1, max_tokens=1))
    s.add_request(rq("b-high", "b", priority=0, max_tokens=1))
    done = [r.request_id for r in FakeRunner(s).run()]
    # b-high ties A on priority and wins on its (lower) counter once A has been served; b-low, worse
    # priority, goes after every priority-0 request however little B was served.
    assert done.index("b-high") <= 2 and done[-1] == "b-low"
    assert_clean(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_fcfs_within_a_tenant(policy):
    rng = random.Random(1)
    s = make(policy=policy, max_seqs=3)
    order: dict[str, list[str]] = {}
    for i in range(60):
        t = rng.choice("abc")
        r = rq(f"{t}{i}", t, n_prompt=rng.randrange(2, 30))
        s.add_request(r)
        order.setdefault(t, []).append(r.request_id)
    first = first_scheduled_steps(s, {})
    for t, rids in order.items():
        assert sorted(rids, key=lambda rid: (first[rid], rids.index(rid))) == rids, t
    assert_clean(s)


@pytest.mark.parametrize("seed", range(3))
def test_one_tenant_schedules_exactly_like_the_plain_queue(seed):
    def trace(fair: bool) -> list:
        rng = random.Random(seed)
        s = make(fair=fair, num_blocks=16, budget=12, max_seqs=5, policy=rng.choice(["fcfs", "priority"]))
        runner, log = FakeRunner(s, token=lambda r: rng.choice([EOS, 3, 4])), []
        for i in range(80):
            if rng.random() < 0.6:
                s.add_request(rq(f"r{i}", "solo", n_prompt=rng.randrange(1, 30), max_tokens=rng.randrange(1, 8),
                                 priority=rng.randrange(3)))
            out, _ = runner.step()
            log.append(([(x.request.request_id, x.num_new_tokens) for x in out.scheduled], out.preempted))
        runner.run()
        assert_clean(s)
        return log

    assert trace(True) == trace(False)


def tenant_blocks(s: Scheduler, tenant: str) -> int:
    bm = s.block_manager
    return len({b for r in s.running if r.tenant == tenant for b in bm.block_ids(r.request_id)})


def test_kv_quota_holds_a_tenant_back_without_blocking_others():
    s = make(quota=0.25, num_blocks=64, max_seqs=8)  # A may admit while holding at most 16 blocks
    for i in range(40):
        s.add_request(rq(f"a{i}", "a", n_prompt=24, max_tokens=4))  # 6 blocks at admission, 7 at the end
    runner = FakeRunner(s)
    most_a, b_waits, b_arrived = 0, [], {}
    for step in range(40):
        if step % 4 == 0:
            b_arrived[f"b{step}"] = step
            s.add_request(rq(f"b{step}", "b", n_prompt=8, max_tokens=2))
        out, _ = runner.step()
        a_running = [r for r in s.running if r.tenant == "a"]
        most_a = max(most_a, len(a_running))
        # admission stops at the quota; requests already running may still grow one block each
        assert tenant_blocks(s, "a") <= 16 + len(a_running)
        b_waits += [step - b_arrived.pop(x.request.request_id) for x in out.scheduled
                    if x.request.request_id in b_arrived]
    assert most_a == 2  # 16 blocks fit two 6-7 block requests, not the 8 slots max_num_seqs allows
    assert b_waits == [0] * 10  # A waiting at its quota never holds B up
    runner.run(max_steps=2000)
    assert_clean(s)
    # without the quota A fills every slot it can
    s = make(num_blocks=64, max_seqs=8)
    for i in range(40):
        s.add_request(rq(f"a{i}", "a", n_prompt=24, max_tokens=4))
    runner = FakeRunner(s)
    for _ in range(3):
        runner.step()
    assert s.num_running > 2


def test_kv_quota_never_makes_a_request_unservable():
    s = make(quota=0.1, num_blocks=64)  # 6 blocks, but this request needs 9
    s.add_request(rq("big", "a", n_prompt=32, max_tokens=4))
    s.add_request(rq("next", "a", n_prompt=4, max_tokens=1))
    done = FakeRunner(s).run()
    assert [r.request_id for r in done] == ["big", "next"] and all(r.status.value == "length" for r in done)
    assert_clean(s)


@pytest.mark.parametrize("prompts", [(20, 52, 20), (24, 50, 17)], ids=["its-own-growth", "another-tenants-growth"])
def test_when_blocks_run_out_a_tenant_past_its_quota_is_preempted_first(prompts):
    """Running [b, a1, c], a1's tenant past its half of 24 blocks (13: a tenant holding none may start one),
    the pool full. Whoever needs a block first, a1 itself or b, a1 goes, not c at the tail: growth past a quota
    costs its own tenant. In the first case a1 preempts itself from the middle of the list, and c, behind it,
    is still scheduled in that step."""
    pb, pa, pc = prompts  # block 4: 5 + 13 + 5 blocks (a1 needs a 14th first), or 6 + 13 + 5 (b needs a 7th)
    s = make(quota=0.5, num_blocks=24, budget=128, max_seqs=8)
    for r in (rq("b", "b", n_prompt=pb, max_tokens=40), rq("a1", "a", n_prompt=pa, max_tokens=40),
              rq("c", "c", n_prompt=pc, max_tokens=40)):
        s.add_request(r)
    runner = FakeRunner(s)
    runner.step()
    assert [r.request_id for r in s.running] == ["b", "a1", "c"] and s.tenant_blocks()["a"] == 13
    out, _ = runner.step()
    assert out.preempted == ["a1"]
    assert {x.request.request_id for x in out.scheduled} == {"b", "c"}
    done = runner.run(max_steps=2000)
    assert sorted(r.request_id for r in done) == ["a1", "b", "c"]
    assert_clean(s)


def test_handed_off_requests_count_against_the_quota_as_admission_counts_it():
    """What a decode worker asks before granting a handoff (EngineCore.tenant_kv_blocks, over_tenant_kv_quota):
    handed-off requests enter the running set without admission, and still count."""
    s = make(quota=0.25, num_blocks=64)  # 16 blocks a tenant
    r = rq("handed", "a", n_prompt=24)
    assert s.block_manager.allocate_for_tokens("handed", 24)  # 6 blocks
    r.output_token_ids, r.num_computed_tokens = [5], 24
    s.add_prefilled_request(r)
    assert s.tenant_blocks() == {"a": 6}
    assert not s.over_quota(6, 10) and s.over_quota(6, 11)
    assert not s.over_quota(0, 64)  # a tenant holding none may always start one


def test_quota_must_be_a_fraction():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="tenant_kv_quota"):
            SchedulerConfig(tenant_kv_quota=bad)


def test_prefix_cache_is_never_shared_across_tenants():
    rng = random.Random(0)
    s = make(num_blocks=40, budget=16, max_seqs=6)
    runner = FakeRunner(s)
    shared_prefix = list(range(20, 40))  # every request starts with it: only same-namespace hits allowed
    hits: dict[str, int] = {}
    for i in range(150):
        tenant = rng.choice(["a", "b", "default"])
        salt = rng.choice([None, "s"])  # equal salts across tenants must still not share
        r = Request(f"r{i}", shared_prefix + [rng.randrange(50, 90) for _ in range(rng.randrange(1, 6))],
                    SamplingParams(), eos_token_id=EOS, max_tokens=2, tenant=tenant, cache_salt=salt)
        s.add_request(r)
        out, _ = runner.step()
        owners: dict[int, set] = {}
        for req in s.running:
            for b in s.block_manager.block_ids(req.request_id):
                owners.setdefault(b, set()).add(cache_namespace(req.tenant, req.cache_salt))
        assert all(len(ns) == 1 for ns in owners.values())
        for x in out.scheduled:
            hits[x.request.tenant] = hits.get(x.request.tenant, 0) + x.request.num_cached_tokens
    runner.run()
    assert_clean(s)
    assert all(hits.get(t, 0) > 0 for t in ("a", "b", "default"))  # caching works within a tenant


def test_cache_namespaces_cannot_be_forged():
    ns = cache_namespace
    assert ns("default", None) is None and ns("default", "s") == "s"  # single-tenant hashes unchanged
    spaces = [ns("a", None), ns("a", "s"), ns("b", "s"), ns("default", "s"), ns("a", ""),
              ns("default", ns("a", "s")), ns("a:1", None), ns("a", ":1")]
    assert len(set(spaces)) == len(spaces)
    # the same tokens under two tenants hash to different blocks, so one can never hit the other's
    bm = BlockManager(8, BS)
    a = Request("a", list(range(12)), SamplingParams(), tenant="a", cache_salt="s")
    bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_blocks(a, 12)
    b = Request("b", list(range(12)), SamplingParams(), tenant="b", cache_salt="s")
    a2 = Request("a2", list(range(12)), SamplingParams(), tenant="a", cache_salt="s")
    assert bm.get_computed_blocks(b) == ([], 0)
    assert bm.get_computed_blocks(a2)[1] == 8
