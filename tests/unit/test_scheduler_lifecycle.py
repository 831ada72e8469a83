"""How a request leaves the scheduler: stop conditions, tokens past a stop, finished KV held until released,
requests whose KV was prefilled elsewhere, and aborts in every state."""

import pytest

from kvrelay.shared.engine.request import Request, RequestStatus
from tests.unit.scheduler_runner import EOS, FakeRunner, assert_clean, make, rq, two_growing


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
    runner = two_growing(s)
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

