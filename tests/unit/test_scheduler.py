"""Scheduler on the CPU with a fake runner (tests/unit/scheduler_runner.py): the token budget, chunked
prefill mixed with decodes, admission with chunking off, max_num_seqs and priority order."""

import pytest

from kvrelay.shared.engine.request import RequestStatus
from tests.unit.scheduler_runner import FakeRunner, assert_clean, batch, make, rq


def test_budget_and_chunked_prefill_split():
    s = make(budget=16)
    for i in range(3):
        s.add_request(rq(f"r{i}", 30, max_tokens=2, base=10 + i))  # distinct prompts: none waits for another
    runner = FakeRunner(s)
    out, _ = runner.step()
    assert [(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [("r0", 16, False)]
    out, _ = runner.step()
    assert batch(out) == [("r0", 14), ("r1", 2)]
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
    assert batch(out) == [("short", 1), ("long", 15)]
    out, _ = runner.step()
    assert batch(out) == [("short", 1), ("long", 15)]
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
    assert batch(out) == [("a", 20)]
    out, _ = runner.step()
    assert batch(out) == [("a", 1), ("b", 20), ("c", 4)]
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
    assert batch(out) == [("p1", 20)]


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(5):
        s.add_request(rq(f"r{i}", 5, max_tokens=3, base=10 + i))
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



def test_priority_admission_order():
    s = make(max_seqs=1, policy="priority")
    for rid, prio in [("p2", 2), ("p0", 0), ("p1a", 1), ("p1b", 1)]:
        s.add_request(rq(rid, 3, max_tokens=1, priority=prio))
    done = FakeRunner(s).run()
    assert [r.request_id for r in done] == ["p0", "p1a", "p1b", "p2"]
    assert_clean(s)

