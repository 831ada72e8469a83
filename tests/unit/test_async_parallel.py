"""Async scheduling (shared/engine/async_step.py) on a rank group, in real processes over gloo: rank 0 samples,
and the ids it sampled a step ago reach the other ranks' input ids in a broadcast from rank 0 (the step's
message names the rows), never through rank 0's host. Token ids, finish and stop reasons equal the
synchronous one-process engine's on tensor-parallel 2, pipeline 2 and both, over requests that end
mid-batch every way (EOS under min_tokens, stop tokens, max_tokens differing per request) and aborts."""

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.cli import build_parser
from kvrelay.serve_plan import models_to_serve, plan
from kvrelay.workers import worker_config
from tests.conftest import random_prompts
from tests.unit.parallel_ranks import check_a_killed_rank_ends_the_engine
from tests.unit.parallel_ranks import children as _children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EOS = 2  # the tiny checkpoints' eos_token_id
STOPS = list(range(100, 140))  # ~8% of the vocabulary: most requests meet one within a few tokens
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=STOPS),
    # EOS made likely but banned for 4 tokens: ends right at min_tokens, which counts the unread token
    SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4, logit_bias={EOS: 30.0}),
    SamplingParams(temperature=0.0, max_tokens=9, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=1),
    SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1),  # every row's logits, mid-prompt too
    # ids from the upper half of the vocabulary, which rank 1 of a pair embeds (vocab-parallel), the model still
    # choosing among them; the penalty counts the token sampled a step ago (still unread on rank 0's host)
    SamplingParams(temperature=0.0, max_tokens=12, logit_bias=dict.fromkeys(range(256, 512), 5.0),
                   frequency_penalty=0.5),
]
ABORT_AFTER = {0: 3, 7: 5}  # request index -> tokens seen when the client hangs up
_reference: dict[str, dict] = {}


def generate(model_dir, device: str = "cpu", **kwargs) -> tuple[dict[str, list], int | None]:
    """Each request's (token ids, finish reason, stop reason) and the decode tokens fed device to device."""
    with LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=32, block_size=8,
             device=device, **kwargs) as llm:
        engine = llm.engine
        prompts = random_prompts(14, lo=3, hi=50, seed=4)
        ids = [engine.add_request({"prompt_token_ids": p}, PARAMS[i % len(PARAMS)]) for i, p in enumerate(prompts)]
        seen: dict[str, list] = {rid: [[], None, None] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step(delta=True):
                got = seen[out.request_id]
                got[0] += out.outputs[0].token_ids
                if out.finished:
                    got[1:] = [out.outputs[0].finish_reason, out.outputs[0].stop_reason]
            for i, after in ABORT_AFTER.items():
                if len(seen[ids[i]][0]) >= after and ids[i] in engine.processor.requests:
                    engine.abort(ids[i])
        core = engine.core
        assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
        return seen, core.stepper.num_fed if core.stepper is not None else None


def synchronous_one_process(model_dir) -> dict[str, list]:
    key = str(model_dir)
    if key not in _reference:
        _reference[key] = generate(model_dir)[0]
        runs = list(_reference[key].values())
        assert {"stop", "length"} <= {r[1] for r in runs}
        assert any(r[2] in STOPS for r in runs) and any(r[0][-1:] == [EOS] for r in runs)
        assert [len(runs[i][0]) for i in ABORT_AFTER] == list(ABORT_AFTER.values())
    return _reference[key]


@pytest.mark.parametrize(("arch", "layout"), [
    ("llama", dict(tensor_parallel_size=2)),
    ("gpt2", dict(tensor_parallel_size=2)),  # learned positions, tied vocab-parallel head
    ("llama", dict(pipeline_parallel_size=2)),
    # stage 0's second rank embeds the fed ids too: without them it would disagree with rank 0
    ("llama", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
], ids=["tp2-llama", "tp2-gpt2", "pp2-llama", "tp2xpp2-llama"])
def test_async_group_equals_synchronous_one_process(tiny_model_dirs, arch, layout):
    expected = synchronous_one_process(tiny_model_dirs[arch])
    before = _children()
    got, num_fed = generate(tiny_model_dirs[arch], async_scheduling=True, **layout)
    assert got == expected
    assert num_fed > 0  # decode tokens really went from one step to the next on the device
    assert _children() == before


def test_killed_rank_fails_an_async_engine_promptly(tiny_model_dirs):
    before = _children()
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, tensor_parallel_size=2,
              async_scheduling=True)
    check_a_killed_rank_ends_the_engine(llm, "tensor", before)


@pytest.mark.parametrize("role", ["unified", "decode"])
def test_a_worker_takes_async_scheduling_with_a_group(role):
    args = build_parser().parse_args([f"{role}-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--tensor-parallel-size", "2", "--async-scheduling"])
    engine = worker_config(role, args).engine
    assert engine.async_scheduling and engine.tensor_parallel_size == 2


def test_serve_gives_a_groups_decode_worker_async_scheduling_and_its_prefill_worker_none():
    args = build_parser().parse_args(["serve", "--model", "dummy:tiny-llama", "--tensor-parallel-size", "2",
                                      "--device", "cpu", "--async-scheduling"])
    engines = {c.command: (c.config.engine.async_scheduling, c.config.engine.tensor_parallel_size)
               for c in plan(args, models_to_serve(args), "redis://x") if not c.is_gateway}
    assert engines == {"prefill-worker": (None, 2), "decode-worker": (True, 2)}
