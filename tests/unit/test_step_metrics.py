"""The worker's step histograms from a real engine (tiny random llama, CPU), synchronous and async: step time by
what the gap held (kvrelay_engine_step_seconds: decode, mixed, prefill) and the prompt tokens each step with
decode rows took beside them (kvrelay_engine_step_prompt_tokens), under a prompt-token cap. What they must show
is which gaps a step with prompt tokens was in: with async scheduling the next step is launched inside the gap
before its own, so the decode step read after a mixed step's launch counts as mixed too. No timing is checked."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.llm import LLM
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.metrics import WorkerMetrics
from tests.conftest import random_prompts

CAP = 16  # a bucket bound of the histogram, so the check below is exact
LATE = 48


def samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def count(snap, name: str, **labels) -> float:
    return snap.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


def run(model_dir, async_scheduling: bool) -> dict[tuple, float]:
    """Two requests decode; a LATE-token prompt arrives while they do and is prefilled in chunks of CAP beside them."""
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, async_scheduling=async_scheduling,
              max_prefill_tokens_with_decodes=CAP)
    core = llm.engine.core
    metrics = WorkerMetrics(core, "tiny", "unified", "w1", process_collectors=False)
    core.observer = metrics
    decoding, late = random_prompts(2, lo=6, hi=6, seed=1), random_prompts(1, lo=LATE, hi=LATE, seed=2)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(decoding):
        core.add_request(core.make_request(f"d{i}", prompt, params))
    for _ in range(4):
        core.step()
    core.add_request(core.make_request("late", late, params))
    while core.has_unfinished():
        core.step()
    return samples(metrics.registry)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_time_by_kind_and_prompt_tokens_beside_decodes(tiny_model_dirs, async_scheduling):
    snap = run(tiny_model_dirs["llama"], async_scheduling)
    steps = {k: count(snap, "kvrelay_engine_steps_total", kind=k) for k in ("decode", "prefill", "mixed")}
    timed = {k: count(snap, "kvrelay_engine_step_seconds_count", kind=k) for k in ("decode", "prefill", "mixed")}
    assert steps["mixed"] == LATE // CAP  # the late prompt went in chunks beside the decodes
    assert sum(timed.values()) == sum(steps.values())  # every step that computed something is timed, once
    if async_scheduling:
        # the decode step read while the first chunk was launched waited for that launch: one more mixed gap
        assert timed["mixed"] > steps["mixed"]
    else:
        assert timed == steps
    # every step with decode rows, and no prompt tokens beside them past the cap
    beside = count(snap, "kvrelay_engine_step_prompt_tokens_count")
    assert beside == steps["decode"] + steps["mixed"]
    assert count(snap, "kvrelay_engine_step_prompt_tokens_bucket", le=str(float(CAP))) == beside
    assert count(snap, "kvrelay_engine_step_prompt_tokens_bucket", le="0.0") == steps["decode"]
    assert count(snap, "kvrelay_engine_step_prompt_tokens_sum") == LATE  # all of the late prompt ran beside decodes
