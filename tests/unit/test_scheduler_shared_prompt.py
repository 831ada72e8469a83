"""Requests with one prompt (the siblings of an ``n > 1`` request) compute it once: the others wait until the
first one's full prompt blocks are cached, then compute only the partial last block (prompt_sharing.py).
Prompt tokens are counted from the scheduler's outputs."""

from kvrelay.shared.engine.request import RequestStatus
from kvrelay.shared.engine.scheduler import SchedulerOutput
from tests.unit.scheduler_runner import BS, FakeRunner, assert_clean, make, rq


def prompt_tokens(out: SchedulerOutput) -> int:
    """Prompt tokens the step computes (called before the step's results advance the requests)."""
    total = 0
    for s in out.scheduled:
        r = s.request
        total += max(0, min(r.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) - r.num_computed_tokens)
    return total


def step_with(runner: FakeRunner, out: SchedulerOutput) -> list:
    """Run the step ``out`` that the test scheduled (and looked at) itself."""
    runner.sched.schedule = lambda: out
    try:
        return runner.step()[1]
    finally:
        del runner.sched.schedule


def run_counting(runner: FakeRunner, max_steps: int = 200) -> tuple[int, list]:
    computed, done = 0, []
    for _ in range(max_steps):
        if not runner.sched.has_unfinished():
            return computed, done
        out = runner.sched.schedule()
        computed += prompt_tokens(out)
        done += step_with(runner, out)
    raise AssertionError("scheduler did not drain")


def siblings(n: int, n_prompt: int, **kw) -> list:
    return [rq(f"p-{i}", n_prompt, max_tokens=3, base=10, **kw) for i in range(n)]


def queued_siblings(n: int, n_prompt: int) -> tuple:
    """A scheduler whose steps admit 8 prompt tokens, its runner, and ``n`` siblings queued in it."""
    s = make(num_blocks=96, max_model_len=64, budget=8)
    sibs = siblings(n, n_prompt)
    for r in sibs:
        s.add_request(r)
    return s, FakeRunner(s), sibs


def test_siblings_compute_the_prompt_once_and_others_pass_them():
    s = make(num_blocks=64)
    runner = FakeRunner(s)
    sibs = siblings(8, 18)  # 4 full blocks and 2 tokens
    for r in sibs:
        s.add_request(r)
    other = rq("other", 6, max_tokens=3, base=40)
    # the same prompt in another cache namespace shares nothing, so it does not wait
    tenant2, salted = rq("tenant2", 18, max_tokens=3, base=10), rq("salted", 18, max_tokens=3, base=10)
    tenant2.tenant, salted.cache_salt = "t2", "salt"
    for r in (other, tenant2, salted):
        s.add_request(r)
    out = s.schedule()
    # the leader and the requests queued behind its held siblings start together
    assert sorted(x.request.request_id for x in out.scheduled) == ["other", "p-0", "salted", "tenant2"]
    assert all(r.status is RequestStatus.WAITING for r in sibs[1:])
    step_with(runner, out)
    computed, done = run_counting(runner)
    assert len(done) == 11
    assert computed == 7 * (18 % BS)  # each sibling: only the partial last block
    assert all(r.num_cached_tokens == 16 for r in sibs[1:])
    assert_clean(s)


def test_chunked_long_prompt_siblings_wait_for_every_chunk():
    s, runner, sibs = queued_siblings(8, 30)  # 7 full blocks and 2 tokens, 4 chunks of the budget
    computed, done = run_counting(runner)
    assert len(done) == 8
    assert computed == 30 + 7 * 2
    assert_clean(s)


def test_leader_aborted_mid_prefill_releases_the_others():
    s, runner, sibs = queued_siblings(4, 30)
    out, _ = runner.step()
    assert [x.request.request_id for x in out.scheduled] == ["p-0"]
    s.abort_request("p-0")
    computed, done = run_counting(runner)
    assert sorted(r.request_id for r in done) == ["p-1", "p-2", "p-3"]
    assert all(r.num_output_tokens == 3 for r in done)
    # the leader's first chunk was cached; the next sibling leads the rest, the last two reuse it all
    assert computed == (30 - 8) + 2 * 2
    assert_clean(s)


def test_leader_preempted_releases_the_others():
    s, runner, sibs = queued_siblings(3, 30)
    runner.step()
    out = SchedulerOutput()
    s._running.remove(sibs[0])
    s._preempt(sibs[0], out)  # as the pool running out would
    assert not s.shared_prompts.must_wait(sibs[1])  # a preempted leader holds nobody back
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["p-0"]  # back at the front, it leads again
    assert s.shared_prompts.must_wait(sibs[1])
    step_with(runner, out)
    _, done = run_counting(runner)
    assert len(done) == 3
    assert_clean(s)
