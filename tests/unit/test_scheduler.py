"""Scheduler on the CPU with a fake runner: budget, chunked prefill, admission, preemption (recompute and
swap), priority, stop conditions, KV holding, prefilled requests, aborts, and no block leaks.

The fake runner keeps a 'KV cache' whose slots hold the token prefix they were computed from. Before
each step it checks that every already-computed position reads back the right prefix through the
request's block table, so a wrong prefix hit, a bad swap pair or a reused live block fails the test.
"""

import random

import pytest

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager, cdiv
from kvrelay.shared.engine.request import Request, RequestStatus
from kvrelay.shared.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 4
EOS = 2


class FakeRunner:
    def __init__(self, sched: Scheduler, token=lambda req: 7):
        bm = sched.block_manager
        self.sched, self.bm, self.token = sched, bm, token
        self.dev: list[list] = [[None] * BS for _ in range(bm.num_blocks)]
        self.host: list[list] = [[None] * BS for _ in range(sched.host_pool.num_blocks)]

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        out = self.sched.schedule()
        check_invariants(self.sched, out)
        for d, h in out.swap_out:  # the order the real runner uses: swap-outs, swap-ins, compute
            self.host[h] = list(self.dev[d])
        for h, d in out.swap_in:
            self.dev[d] = list(self.host[h])
        sampled = {}
        for s in out.scheduled:
            r, c = s.request, s.request.num_computed_tokens
            toks = r.all_token_ids
            for p in range(c):
                assert self.dev[s.block_ids[p // BS]][p % BS] == (r.cache_salt, tuple(toks[: p + 1])), (r.request_id, p)
            for p in range(c, c + s.num_new_tokens):
                block = s.block_ids[p // BS]
                assert self.bm.ref_cnt[block] == 1, "writing into a shared block"
                self.dev[block][p % BS] = (r.cache_salt, tuple(toks[: p + 1]))
            if s.sample:
                sampled[r.request_id] = [self.token(r)]
        return out, self.sched.update_from_output(out, sampled)

    def run(self, max_steps: int = 500) -> list[Request]:
        done = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return done
            done += self.step()[1]
        raise AssertionError("scheduler did not drain")


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        r = s.request
        assert s.num_new_tokens > 0 and r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        assert len(s.block_ids) >= cdiv(r.num_computed_tokens + s.num_new_tokens, BS)
        assert r.status is RequestStatus.RUNNING
    bm = sched.block_manager
    owned = sum(len(v) for v in bm.req_blocks.values())
    assert owned == sum(bm.ref_cnt)  # every reference belongs to exactly one table entry
    assert not set(bm.free_queue) & {b for b, n in enumerate(bm.ref_cnt) if n}
    assert len({h for _, h in out.swap_out}) == len(out.swap_out)
    # A request preempted this step is neither scheduled nor re-admitted in it.
    assert not set(out.preempted) & {x.request.request_id for x in out.scheduled}


def make(
    num_blocks=64,
    max_model_len=64,
    budget=None,
    chunked=True,
    max_seqs=256,
    policy="fcfs",
    host=0,
    prefix=True,
    hold=False,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked, policy=policy
    )
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(cfg, bm, max_model_len, num_host_blocks=host, enable_prefix_caching=prefix, hold_finished_kv=hold)


def rq(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 10, priority: int = 0, **sp) -> Request:
    prompt = [base + (i % 50) for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(**sp), eos_token_id=EOS, max_tokens=max_tokens, priority=priority)


def assert_clean(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks and bm.usage == 0
    assert sched.host_pool.num_free_blocks == sched.host_pool.num_blocks
    assert bm.req_blocks == {} and sched.num_held == 0


def test_budget_and_chunked_prefill_split():
    s = make(budget=16)
    for i in range(3):
        s.add_request(rq(f"r{i}", 30, max_tokens=2))
    runner = FakeRunner(s)
    out, _ = runner.step()
    assert [(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [("r0", 16, False)]
    out, _ = runner.step()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("r0", 14), ("r1", 2)]
    assert out.scheduled[0].sample and not out.scheduled[1].sample
    done = runner.run()
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert all(r.num_output_tokens == 2 and r.status is RequestStatus.FINISHED_LENGTH for r in done)
    assert_clean(s)


def test_long_prefill_mixes_with_decodes():
    s = make(budget=16)
    s.add_request(rq("short", 4, max_tokens=10))
    runner = FakeRunner(s)
    runner.step()
    s.add_request(rq("long", 40, max_tokens=1))
    out, _ = runner.step()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 1), ("long", 15)]
    out, _ = runner.step()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 1), ("long", 15)]
    runner.run()
    assert_clean(s)


def test_chunked_off_admission():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\).*max_model_len \(32\)"):
        make(max_model_len=32, budget=16, chunked=False)
    assert make(max_model_len=32, chunked=False).max_num_batched_tokens == 32
    assert make(max_model_len=32).max_num_batched_tokens == 2048
    s = make(max_model_len=32, chunked=False)
    for rid, n, base in [("a", 20, 10), ("b", 20, 40), ("c", 4, 70)]:
        s.add_request(rq(rid, n, max_tokens=3, base=base))
    runner = FakeRunner(s)
    out, _ = runner.step()  # b does not fit the 12 tokens left, and c may not overtake it
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 20)]
    out, _ = runner.step()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 20), ("c", 4)]
    runner.run()
    assert_clean(s)


def test_chunked_off_never_splits_a_running_request():
    s = make(max_model_len=32, chunked=False)
    for rid in ("p1", "p2"):  # KV for 2 of 21 prompt tokens arrived; 20 tokens left to compute each
        s.block_manager.allocate_for_tokens(rid, 22)
        r = rq(rid, 21, base=10 if rid == "p1" else 60)
        r.output_token_ids, r.num_computed_tokens = [5], 2
        s.add_prefilled_request(r)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("p1", 20)]


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(5):
        s.add_request(rq(f"r{i}", 5, max_tokens=3))
    runner = FakeRunner(s)
    out, _ = runner.step()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"] and s.num_waiting == 3
    seen = []
    while s.has_unfinished():
        out, _ = runner.step()
        assert s.num_running <= 2
        seen += [x.request.request_id for x in out.scheduled if x.request.request_id not in seen]
    assert seen[:3] == ["r0", "r1", "r2"] and "r4" in seen
    assert_clean(s)


def _two_growing(s: Scheduler) -> FakeRunner:
    """a and b fill the 4-block pool; at the third step a needs a new block."""
    s.add_request(rq("a", 7, max_tokens=4, base=10))
    s.add_request(rq("b", 7, max_tokens=4, base=30))
    runner = FakeRunner(s)
    out, _ = runner.step()
    assert len(out.scheduled) == 2 and s.block_manager.num_free_blocks == 0
    out, _ = runner.step()
    assert not out.preempted
    return runner


def test_preempt_by_recompute():
    s = make(num_blocks=4, max_model_len=16)
    runner = _two_growing(s)
    b = s.running[1]
    out, _ = runner.step()
    assert out.preempted == ["b"] and not out.swap_out
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_output_tokens == 2
    assert s.waiting == [b]
    done = runner.run()
    assert [r.request_id for r in done] == ["a", "b"] and b.num_output_tokens == 4
    assert_clean(s)


def test_preempt_by_swap():
    s = make(num_blocks=4, max_model_len=16, host=8)
    runner = _two_growing(s)
    b = s.running[1]
    b_blocks = s.block_manager.block_ids("b")
    out, _ = runner.step()
    assert out.preempted == ["b"]
    assert out.swap_out == list(zip(b_blocks, [0, 1], strict=True))
    assert b.swapped_blocks == [0, 1] and b.num_computed_tokens == 8 and b.status is RequestStatus.PREEMPTED
    assert s.host_pool.num_free_blocks == 6
    resumed = None
    while resumed is None:
        out, _ = runner.step()
        resumed = next((x for x in out.scheduled if x.request is b), None)
    assert out.swap_in == list(zip([0, 1], resumed.block_ids[:2], strict=True))
    assert resumed.num_new_tokens == 1  # only the token sampled before the swap is left to compute
    assert b.swapped_blocks is None and s.host_pool.num_free_blocks == 8
    runner.run()
    assert b.num_output_tokens == 4
    assert_clean(s)


def test_swap_falls_back_to_recompute_without_host_room():
    s = make(num_blocks=4, max_model_len=16, host=1)
    runner = _two_growing(s)
    b = s.running[1]
    out, _ = runner.step()
    assert out.preempted == ["b"] and not out.swap_out and b.num_computed_tokens == 0
    runner.run()
    assert_clean(s)


@pytest.mark.parametrize("policy, victim", [("fcfs", "late"), ("priority", "early")])
def test_preemption_victim_follows_policy(policy, victim):
    s = make(num_blocks=4, max_model_len=16, policy=policy)
    s.add_request(rq("early", 7, max_tokens=4, base=10, priority=1))
    runner = FakeRunner(s)
    runner.step()
    s.add_request(rq("late", 7, max_tokens=4, base=30, priority=0))  # admitted after early, yet ranks first
    runner.step()
    assert [r.request_id for r in s.running] == (["early", "late"] if policy == "fcfs" else ["late", "early"])
    out, _ = runner.step()
    assert out.preempted == [victim]
    runner.run()
    assert_clean(s)


def test_priority_admission_order():
    s = make(max_seqs=1, policy="priority")
    for rid, prio in [("p2", 2), ("p0", 0), ("p1a", 1), ("p1b", 1)]:
        s.add_request(rq(rid, 3, max_tokens=1, priority=prio))
    done = FakeRunner(s).run()
    assert [r.request_id for r in done] == ["p0", "p1a", "p1b", "p2"]
    assert_clean(s)


def _decode_with(tokens: list[int], req: Request, max_model_len: int = 64) -> Request:
    s = make(max_model_len=max_model_len)
    s.add_request(req)
    it = iter(tokens)
    FakeRunner(s, token=lambda r: next(it)).run()
    assert_clean(s)
    return req


def test_stop_conditions():
    r = _decode_with([5, EOS, 6], rq("eos", 3, max_tokens=8))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, EOS] and r.stop_reason is None
    r = _decode_with([5, EOS, 6, 7], rq("ign", 3, max_tokens=4, ignore_eos=True))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [5, EOS, 6, 7]
    r = _decode_with([5, 99, 6], rq("sid", 3, max_tokens=8, stop_token_ids=[99]))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 99
    r = _decode_with([EOS, 99, EOS, 5], rq("min", 3, max_tokens=8, min_tokens=3, stop_token_ids=[99]))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS, 99, EOS]
    r = _decode_with([5] * 10, rq("len", 3, max_tokens=5))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 5
    r = _decode_with([5] * 10, rq("ctx", 10, max_tokens=50), max_model_len=13)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 13


def test_tokens_past_a_stop_are_dropped_and_mid_prompt_samples_rejected():
    s = make(budget=8)
    r = rq("a", 3, max_tokens=8)
    s.add_request(r)
    out = s.schedule()
    assert s.update_from_output(out, {"a": [5, EOS, 6]}) == [r]
    assert r.output_token_ids == [5, EOS]
    s.add_request(rq("b", 20))
    out = s.schedule()
    with pytest.raises(ValueError, match="mid-prompt"):
        s.update_from_output(out, {"b": [5]})


def test_hold_finished_kv_until_released():
    s = make(num_blocks=8, hold=True)
    r = rq("p", 9, max_tokens=1)
    s.add_request(r)
    runner = FakeRunner(s)
    _, done = runner.step()
    assert done == [r] and r.status is RequestStatus.FINISHED_LENGTH and not s.has_unfinished()
    assert len(s.block_manager.block_ids("p")) == 3 and s.block_manager.num_free_blocks == 5
    with pytest.raises(ValueError):
        s.add_request(rq("p", 3))  # the id is still in use while held
    s.release_held("p")
    s.release_held("p")
    assert_clean(s)
    # Aborts free at once; aborting a held request releases it.
    s.add_request(rq("q", 9, max_tokens=1))
    runner.step()
    assert s.abort_request("q").request_id == "q"
    assert_clean(s)
    s.add_request(rq("x", 9, max_tokens=3))
    s.schedule()
    assert s.abort_request("x").status is RequestStatus.FINISHED_ABORTED and s.num_held == 0
    assert_clean(s)


def test_add_prefilled_request():
    s = make(num_blocks=8)
    bm = s.block_manager
    blocks = bm.allocate_for_tokens("d", 8)
    r = rq("d", 8, max_tokens=3)
    r.output_token_ids = [5]
    r.num_computed_tokens = 8
    s.add_prefilled_request(r)
    assert s.running == [r] and r.status is RequestStatus.RUNNING
    out = s.schedule()
    assert [(x.num_new_tokens, x.sample) for x in out.scheduled] == [(1, True)]
    assert out.scheduled[0].block_ids[:2] == blocks and len(out.scheduled[0].block_ids) == 3
    s.update_from_output(out, {"d": [6]})
    out = s.schedule()
    s.update_from_output(out, {"d": [7]})
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [5, 6, 7]
    assert_clean(s)
    with pytest.raises(ValueError):
        s.add_prefilled_request(rq("nokv", 8))  # no blocks were allocated for it


def test_abort_waiting_running_swapped():
    s = make(num_blocks=4, max_model_len=16, host=8)
    runner = _two_growing(s)
    s.add_request(rq("w", 3))
    runner.step()  # b swapped out
    assert s.waiting[0].swapped_blocks
    assert s.abort_request("b").status is RequestStatus.FINISHED_ABORTED
    assert s.host_pool.num_free_blocks == 8
    assert s.abort_request("w").status is RequestStatus.FINISHED_ABORTED
    assert s.abort_request("a").status is RequestStatus.FINISHED_ABORTED
    assert s.abort_request("a") is None and s.abort_request("never") is None
    assert_clean(s)
    assert s.schedule().empty


def test_abort_between_schedule_and_update():
    s = make()
    s.add_request(rq("a", 5))
    out = s.schedule()
    s.abort_request("a")
    assert s.update_from_output(out, {"a": [5]}) == []
    assert_clean(s)


def test_request_that_can_never_fit_is_aborted_not_deadlocked():
    s = make(num_blocks=4, max_model_len=64, chunked=False)
    s.add_request(rq("huge", 20))  # 5 blocks, pool has 4
    s.add_request(rq("ok", 5, max_tokens=2))
    runner = FakeRunner(s)
    out, done = runner.step()
    assert [r.request_id for r in out.aborted] == ["huge"] and done[0].request_id == "huge"
    assert "KV blocks" in done[0].stop_reason and done[0].status is RequestStatus.FINISHED_ABORTED
    assert [x.request.request_id for x in out.scheduled] == ["ok"]
    # A running request that outgrows the pool ends the same way instead of preempting forever.
    s.add_request(rq("grows", 14, max_tokens=10))
    done = runner.run()
    grows = next(r for r in done if r.request_id == "grows")
    assert grows.status is RequestStatus.FINISHED_ABORTED and grows.num_tokens == 17
    assert_clean(s)


def test_prefix_cache_reuse_and_prompt_logprobs_opt_out():
    s = make()
    runner = FakeRunner(s)
    s.add_request(rq("a", 18, max_tokens=1))
    runner.run()
    b = rq("b", 18, max_tokens=1)
    s.add_request(b)
    out, _ = runner.step()
    assert b.num_cached_tokens == 16 and out.scheduled[0].num_new_tokens == 2
    c = rq("c", 18, max_tokens=1, prompt_logprobs=1)
    s.add_request(c)
    out, _ = runner.step()
    assert c.num_cached_tokens == 0 and out.scheduled[0].num_new_tokens == 18
    assert_clean(s)


@pytest.mark.parametrize("host", [0, 6])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_kv_consistent_and_leaks_nothing(seed, chunked, host):
    rng = random.Random(seed)
    s = make(
        num_blocks=12,
        max_model_len=40,
        budget=None if not chunked else 12,
        max_seqs=5,
        host=host,
        policy=rng.choice(["fcfs", "priority"]),
    )
    runner = FakeRunner(s, token=lambda r: rng.choice([EOS, 3, 4, 5, 6]))
    shared = [rng.randrange(3, 100) for _ in range(12)]
    live: list[str] = []
    for i in range(60):
        if rng.random() < 0.6:
            n = rng.randrange(1, 20)
            prompt = (shared[: rng.randrange(0, 12)] + [rng.randrange(3, 100) for _ in range(n)])[:30]
            r = Request(
                f"r{i}",
                prompt,
                SamplingParams(min_tokens=rng.choice([0, 2])),
                eos_token_id=EOS,
                max_tokens=rng.randrange(1, 10),
                priority=rng.randrange(3),
                cache_salt=rng.choice([None, None, "t"]),
            )
            s.add_request(r)
            live.append(r.request_id)
        if live and rng.random() < 0.1:
            s.abort_request(live.pop(rng.randrange(len(live))))
        runner.step()
    runner.run()
    assert_clean(s)
