"""Prompt tokens per step while requests decode (``max_prefill_tokens_with_decodes``, Sarathi-Serve's
stall-free batching): capped while anything decodes, the whole budget when nothing does, decodes
never lose their step to a prompt chunk, and greedy outputs are the same with or without the cap."""

import json
import subprocess
import sys

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.scheduler import Scheduler
from tests.conftest import random_prompts
from tests.unit.scheduler_runner import BS, FakeRunner, assert_clean, batch, rq


def make(budget: int, cap: int, policy: str = "fcfs", hold: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_prefill_tokens_with_decodes=cap, policy=policy)
    return Scheduler(cfg, BlockManager(64, BS), max_model_len=128, hold_finished_kv=hold)


def decoding_d_then_prompt_p(s: Scheduler, prompt_len: int = 40, d_tokens: int = 30) -> FakeRunner:
    s.add_request(rq("d", 4, max_tokens=d_tokens))
    runner = FakeRunner(s)
    assert batch(runner.step()[0]) == [("d", 4)]  # d's prompt; it decodes from the next step on
    s.add_request(rq("p", prompt_len, max_tokens=2, base=30))
    return runner


def test_prompt_chunks_capped_while_a_request_decodes():
    s = make(budget=64, cap=8)
    runner = decoding_d_then_prompt_p(s)
    # 40 prompt tokens at 8 a step, each step beside d's decode token; the last chunk samples p's first token
    steps = [runner.step()[0] for _ in range(5)]
    assert [batch(out) for out in steps] == [[("d", 1), ("p", 8)]] * 5
    assert steps[-1].scheduled[1].sample and not any(out.scheduled[1].sample for out in steps[:-1])
    assert batch(runner.step()[0]) == [("d", 1), ("p", 1)]
    runner.run()
    assert_clean(s)


def test_no_cap_when_nothing_decodes():
    s = make(budget=64, cap=8)
    s.add_request(rq("p", 40))
    s.add_request(rq("q", 30, base=30))
    runner = FakeRunner(s)
    # the step's whole budget, split over two prompts: nothing decodes yet
    assert batch(runner.step()[0]) == [("p", 40), ("q", 24)]
    # now p decodes, so q's remaining 6 tokens fit under the cap anyway
    assert batch(runner.step()[0]) == [("p", 1), ("q", 6)]
    runner.run()
    assert_clean(s)


def test_full_budget_again_once_decodes_end():
    s = make(budget=64, cap=8)
    runner = decoding_d_then_prompt_p(s, prompt_len=120, d_tokens=3)  # d ends two steps from now
    assert [batch(runner.step()[0]) for _ in range(2)] == [[("d", 1), ("p", 8)]] * 2
    assert [r.request_id for r in s.running] == ["p"]
    assert batch(runner.step()[0]) == [("p", 64)]  # alone: the whole budget
    runner.run()
    assert_clean(s)


def test_cap_zero_is_no_cap():
    s = make(budget=64, cap=0)
    runner = decoding_d_then_prompt_p(s)
    assert batch(runner.step()[0]) == [("d", 1), ("p", 40)]
    runner.run()
    assert_clean(s)


def test_a_prompt_chunk_ahead_in_the_list_leaves_the_decodes_their_tokens():
    # priority puts the long prompt p ahead of the decoding d in the running list; with the cap off the
    # budget is what a chunk could take from d
    s = make(budget=16, cap=0, policy="priority")
    s.add_request(rq("d", 4, max_tokens=30, priority=1))
    runner = FakeRunner(s)
    runner.step()
    s.add_request(rq("p", 40, max_tokens=2, base=30, priority=0))
    assert batch(runner.step()[0]) == [("d", 1), ("p", 15)]  # admitted after the running d
    assert [r.request_id for r in s.running] == ["p", "d"]
    assert batch(runner.step()[0]) == [("p", 15), ("d", 1)]  # p's chunk leaves d its token
    runner.run()
    assert_clean(s)


def test_prefill_role_never_capped():
    """A prefill worker's requests end at their first token and hold their KV: nothing there decodes."""
    s = make(budget=64, cap=8, hold=True)
    for i in range(3):
        s.add_request(rq(f"p{i}", 40, max_tokens=1, base=10 + 20 * i))
    runner = FakeRunner(s)
    assert [batch(runner.step()[0]) for _ in range(2)] == [[("p0", 40), ("p1", 24)], [("p1", 16), ("p2", 40)]]
    assert not s.has_unfinished() and s.num_held == 3


def test_async_pending_token_counts_as_decoding():
    """With async scheduling a decode's token is still unread when the next step is scheduled."""
    s = make(budget=64, cap=8)
    s.add_request(rq("d", 4, max_tokens=30))
    first = s.schedule()
    s.advance(first)  # launched; its token is read a step later
    s.add_request(rq("p", 40, base=30))
    assert batch(s.schedule()) == [("d", 1), ("p", 8)]


def test_greedy_outputs_same_with_and_without_cap(tiny_model_dirs):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, lo=20, hi=90, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for cap in (0, 16):
        llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8,
                  max_num_batched_tokens=64, max_prefill_tokens_with_decodes=cap)
        outputs[cap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert outputs[0] == outputs[16] and all(len(t) == 12 for t in outputs[0])


@pytest.mark.parametrize(("argv", "want"), [([], 512), (["--max-prefill-tokens-with-decodes", "96"], 96)])
def test_serve_hands_the_cap_to_the_unified_worker(argv, want):
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--mode", "unified", "--model",
                           "dummy:tiny-llama", *argv, "--print-config"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    workers = [c["config"] for c in json.loads(proc.stdout).values() if c["command"] == "unified-worker"]
    assert [w["engine"]["scheduler"]["max_prefill_tokens_with_decodes"] for w in workers] == [want]
