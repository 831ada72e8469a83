"""Scheduler preemption when the KV pool runs out: by recompute or by swap to the host pool (and back), the
victim the policy picks, and a request that can never fit aborted instead of preempting forever."""

import pytest

from kvrelay.shared.engine.request import RequestStatus
from tests.unit.scheduler_runner import FakeRunner, assert_clean, make, rq, two_growing


def test_preempt_by_recompute():
    s = make(num_blocks=4, max_model_len=16)
    runner = two_growing(s)
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
    runner = two_growing(s)
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
    runner = two_growing(s)
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

