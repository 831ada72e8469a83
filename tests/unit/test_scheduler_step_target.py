"""``--target-step-ms``: while requests decode, a step's prompt tokens are what the target leaves beside its decodes
by the fit of the engine's measured steps (shared/engine/step_cost.py), between one KV block and
``max_prefill_tokens_with_decodes``. The scheduler's steps are timed here by a made-up linear cost handed to
``record_step``, as the engine hands it each step's wall time: nothing sleeps or reads a clock."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.engine.step_cost import StepShape
from kvrelay.shared.engine.warmup import warm_up
from kvrelay.shared.worker.metrics import WorkerMetrics
from tests.conftest import random_prompts
from tests.unit.scheduler_runner import BS, FakeRunner, assert_clean, batch, rq

BUDGET, CAP, TARGET_MS = 64, 32, 20.0


def scrape(metrics: WorkerMetrics) -> dict[tuple[str, str], float]:
    """Each kvrelay_ sample by name and its term label ("" where it has none)."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, s.labels.get("term", "")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("kvrelay_")}


def linear(fixed: float, per_row: float, per_prompt: float):
    """Seconds of a step of ``shape``; its decodes' contexts cost nothing here."""
    return lambda shape: fixed + per_row * shape.decode_rows + per_prompt * shape.prompt_tokens


def make(target: float = TARGET_MS, cap: int = CAP) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=BUDGET, max_prefill_tokens_with_decodes=cap, target_step_ms=target)
    return Scheduler(cfg, BlockManager(512, BS), max_model_len=256)


def serve(s: Scheduler, seconds, steps: int = 90) -> list[tuple[list[tuple[str, int]], StepShape]]:
    """Unified serving in small: three requests decode long, a 100-token prompt arrives every 6 steps; each step is
    timed by ``seconds`` and reported. Returns each step's batch and shape."""
    for i in range(3):
        s.add_request(rq(f"d{i}", 4 + 3 * i, max_tokens=70 + 10 * i, base=10 + i))
    runner, seen = FakeRunner(s), []
    for step in range(steps):
        if step % 6 == 3:
            s.add_request(rq(f"p{step}", 100, max_tokens=2, base=100 + step))  # no prefix in common
        out, _ = runner.step()
        s.record_step(out, seconds(out.shape))
        seen.append((batch(out), out.shape))
    runner.run()
    assert_clean(s)
    return seen


def chunks(seen, after: int = 20):
    """(decode rows, prompt tokens) of each step past ``after`` that decoded and held a prompt chunk."""
    return [(shape.decode_rows, shape.prompt_tokens) for _, shape in seen[after:]
            if shape.decode_rows and shape.prompt_tokens]


def test_a_step_records_its_decode_rows_their_context_and_its_prompt_tokens():
    s = make()
    seen = serve(s, linear(10e-3, 1e-3, 0.3e-3), steps=12)
    for rows, shape in seen:
        decodes = [n for _, n in rows if n == 1]  # no prompt chunk here is of one token
        assert shape.decode_rows == len(decodes) and shape.prompt_tokens == sum(n for _, n in rows) - len(decodes)
    s = make()
    s.add_request(rq("d", 5, max_tokens=10))
    runner = FakeRunner(s)
    runner.step()
    runner.step()  # d's context is 6 tokens when its second token is computed
    out, _ = runner.step()
    assert out.shape == StepShape(decode_rows=1, decode_context=6, prompt_tokens=0)


def test_the_cap_is_what_the_target_leaves_beside_the_decodes():
    cost = linear(10.1e-3, 1e-3, 0.3e-3)  # 3 decodes: 13.1 ms, so 20 ms leave 6.9 / 0.3 = 23 prompt tokens
    s = make()
    seen = serve(s, cost)
    capped = chunks(seen)
    assert capped and s.step_cost.warm
    misses = [prompt - (TARGET_MS * 1e-3 - cost(StepShape(rows))) / 0.3e-3 for rows, prompt in capped]
    assert max(misses) <= 1  # never past the target's tokens; a prompt's last chunk is less
    assert sum(abs(miss) <= 1 for miss in misses) > len(capped) / 2
    assert max(p for rows, p in capped if rows == 3) in (22, 23)
    assert max(p for rows, p in capped if rows == 1) in (28, 29)  # fewer decodes leave more
    # before the fit had its steps, the fixed cap
    assert max(p for _, p in chunks(seen[:15], after=0)) == CAP


def test_slow_steps_leave_one_block_a_step_and_fast_ones_the_fixed_cap():
    slow = serve(make(), linear(25e-3, 1e-3, 0.3e-3))  # the decodes alone take longer than the target
    assert {p for _, p in chunks(slow)} == {BS}
    fast = serve(make(), linear(1e-3, 1e-5, 1e-6))
    assert max(p for _, p in chunks(fast)) == CAP
    # off: the same slow steps keep the fixed cap (today's steps)
    off = make(target=0)
    assert off.step_cost is None
    assert max(p for _, p in chunks(serve(off, linear(25e-3, 1e-3, 0.3e-3)))) == CAP


def test_without_a_fixed_cap_the_target_alone_caps_up_to_the_whole_budget():
    fast = serve(make(cap=0), linear(1e-3, 1e-5, 1e-6))
    assert max(rows + p for rows, p in chunks(fast)) == BUDGET  # a token left for each decode
    slow = serve(make(cap=0), linear(25e-3, 1e-3, 0.3e-3))
    assert {p for _, p in chunks(slow)} == {BS}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_times_its_steps_for_the_target_and_outputs_stay_the_same(tiny_model_dirs, async_scheduling):
    """The engine hands the scheduler each step's time, synchronous or async; whatever cap a tiny target then
    gives (it depends on this machine's timings, so no value is asserted), the greedy tokens are the same."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, lo=20, hi=90, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for target in (0.0, 1e-3):
        llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8,
                  max_num_batched_tokens=64, max_prefill_tokens_with_decodes=32, target_step_ms=target,
                  async_scheduling=async_scheduling)
        outputs[target] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        scheduler = llm.engine.core.scheduler
        if target:
            assert scheduler.step_cost.steps >= 12 and scheduler.step_cost.warm
            # a decoding worker shows the cap its last step with decodes had, and the fit's terms
            snap = scrape(WorkerMetrics(llm.engine.core, "tiny", "unified", "w1", process_collectors=False))
            assert snap[("kvrelay_prefill_tokens_cap", "")] == scheduler.last_prefill_cap
            assert 8 <= scheduler.last_prefill_cap <= 32  # one KV block .. the fixed cap
            fit = {term: v for (name, term), v in snap.items() if name == "kvrelay_step_cost_seconds"}
            assert list(fit.values()) == pytest.approx(scheduler.step_cost.coefficients())
            prefill = scrape(WorkerMetrics(llm.engine.core, "tiny", "prefill", "w1", process_collectors=False))
            assert not any(name.startswith(("kvrelay_prefill_tokens_cap", "kvrelay_step_cost")) for name, _ in prefill)
            warm_up(llm.engine.core, compiles=False)  # a worker's warm-up steps are compiles: the fit drops them
            assert scheduler.step_cost.steps == 0
        llm.shutdown()
    assert outputs[0.0] == outputs[1e-3] and all(len(t) == 12 for t in outputs[0.0])


def test_a_saturated_queue_still_gets_the_targets_cap():
    """Three long decodes and a queue of prompts that fill every step to the fixed cap from the first step the fit
    sees: without probing, the fit never sees two prompt sizes, cannot price a token and leaves the cap at 32,
    each step 22.7 ms against a 20 ms target. With it, the steps settle at the target's 22-23 tokens."""
    cost = linear(10.1e-3, 1e-3, 0.3e-3)
    s = make()
    for i in range(3):
        s.add_request(rq(f"d{i}", 4 + 3 * i, max_tokens=400, base=10 + i))
    runner = FakeRunner(s)
    for _ in range(3):
        runner.step()  # the decodes start; warm-up's steps would be forgotten likewise
    for j in range(60):
        s.add_request(rq(f"p{j}", 6 * CAP, max_tokens=1, base=1000 + 300 * j))  # 6 chunks of the cap each
    seen = []
    for _ in range(120):
        out, _ = runner.step()
        s.record_step(out, cost(out.shape))
        seen.append((out.shape.decode_rows, out.shape.prompt_tokens))
    assert seen[:16] == [(3, CAP)] * 16  # not yet warm: the fixed cap
    assert {p for _, p in seen[60:]} <= {22, 23}
    runner.run(max_steps=2000)
    assert_clean(s)
