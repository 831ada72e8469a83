"""The scheduler's KV bookkeeping: prefix-cache reuse (and prompt logprobs opting out of it), and random
workloads that must keep every computed position's KV right and leak no block: shared prefixes, repeated whole
prompts (prompt sharing holds the repeats), aborts, preemption by swap and by recompute, and tenants under a KV
quota (whose preemption picks a tenant past its share first)."""

import random

import pytest

from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.unit.scheduler_runner import EOS, FakeRunner, assert_clean, make, rq


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


@pytest.mark.parametrize("quota", [None, 0.4])
@pytest.mark.parametrize("host", [0, 6])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_kv_consistent_and_leaks_nothing(seed, chunked, host, quota):
    rng = random.Random(seed)
    s = make(
        num_blocks=12,
        max_model_len=40,
        budget=None if not chunked else 12,
        max_seqs=5,
        host=host,
        policy=rng.choice(["fcfs", "priority"]),
        quota=quota,
    )
    runner = FakeRunner(s, token=lambda r: rng.choice([EOS, 3, 4, 5, 6]))
    shared = [rng.randrange(3, 100) for _ in range(12)]
    live: list[str] = []
    prompts: list[list[int]] = []
    for i in range(60):
        if rng.random() < 0.6:
            n = rng.randrange(1, 20)
            prompt = (shared[: rng.randrange(0, 12)] + [rng.randrange(3, 100) for _ in range(n)])[:30]
            if prompts and rng.random() < 0.3:
                prompt = list(rng.choice(prompts))  # a repeat: n > 1 siblings, or the same prompt again
            prompts.append(prompt)
            r = Request(
                f"r{i}",
                prompt,
                SamplingParams(min_tokens=rng.choice([0, 2])),
                eos_token_id=EOS,
                max_tokens=rng.randrange(1, 10),
                priority=rng.randrange(3),
                cache_salt=rng.choice([None, None, "t"]),
                tenant=rng.choice(["a", "a", "b", "c"]),
            )
            s.add_request(r)
            live.append(r.request_id)
        if live and rng.random() < 0.1:
            s.abort_request(live.pop(rng.randrange(len(live))))
        runner.step()
    runner.run()
    assert_clean(s)
