"""The pipeline batch queue (shared/engine/batch_queue.py) in real processes over gloo: two stages keep two
micro-batches of disjoint requests in flight across steps, and the greedy tokens stay HF's (and so one
process's) while requests of many lengths finish and waiting ones join mid-flight, with prompt and sampled
logprobs, with structured outputs, under swap preemption, with two tensor-parallel ranks per stage, and when
requests are aborted while their micro-batch is in flight. A request put in two micro-batches at once would decode from a token
not sampled yet, so every token check below fails if the queue shared requests between micro-batches."""

import math
import re

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.batch_queue import BatchQueueStepper
from kvrelay.shared.wire.structured_outputs import StructuredOutputs
from tests.conftest import random_prompts
from tests.parity import hf_greedy
from tests.unit.parallel_ranks import check_a_killed_rank_ends_the_engine, children, parallel_llm
from tests.unit.test_async_parallel import generate, synchronous_one_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_NEW = 12


def _queued(model_dir, **kwargs) -> LLM:
    return parallel_llm(model_dir, pipeline_parallel_size=2, pipeline_batch_queue=True, block_size=8, **kwargs)


def _lengths(n: int) -> list[int]:
    """max_tokens of request i: from 2 to MAX_NEW, so requests finish at different steps mid-flight."""
    return [2 + (i * 5) % (MAX_NEW - 1) for i in range(n)]


def _check_many_requests(model_dir, **kwargs) -> None:
    prompts = random_prompts(14, lo=2, hi=45, seed=5)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    before = children()
    # 5 seats for 14 requests: waiting ones join while others are in flight
    with _queued(model_dir, max_num_seqs=5, **kwargs) as llm:
        core = llm.engine.core
        assert isinstance(core.stepper, BatchQueueStepper)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=n) for n in _lengths(len(prompts))])
        assert core.stepper.max_in_flight == 2
        assert not core.stepper.busy
        assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
    assert [o.outputs[0].token_ids for o in outs] == [e[:n] for e, n in zip(expected, _lengths(len(prompts)),
                                                                           strict=True)]
    assert children() == before


def test_pp2_batch_queue_greedy_equals_hf_as_requests_finish_and_join(tiny_model_dirs):
    _check_many_requests(tiny_model_dirs["llama"])


def test_tp2_x_pp2_batch_queue_greedy_equals_hf(tiny_model_dirs):
    _check_many_requests(tiny_model_dirs["llama"], tensor_parallel_size=2)


def test_pp2_batch_queue_logprobs_equal_one_process(tiny_model_dirs):
    prompts = random_prompts(5, lo=3, hi=40, seed=7)
    scored = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    with parallel_llm(tiny_model_dirs["llama"], block_size=8) as llm:
        one = llm.generate([{"prompt_token_ids": p} for p in prompts], scored)
    with _queued(tiny_model_dirs["llama"]) as llm:
        two = llm.generate([{"prompt_token_ids": p} for p in prompts], scored)
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_a, pos_b in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                                b.prompt_logprobs[1:] + b.outputs[0].logprobs, strict=True):
            assert pos_a.keys() == pos_b.keys()
            assert all(math.isclose(pos_a[t].logprob, pos_b[t].logprob, abs_tol=1e-4) for t in pos_a)


def test_pp2_batch_queue_swap_preemption_equals_hf(tiny_model_dirs):
    prompts = random_prompts(10, lo=30, hi=60, seed=1)
    expected = hf_greedy(str(tiny_model_dirs["smollm2"]), tuple(map(tuple, prompts)), MAX_NEW)
    with _queued(tiny_model_dirs["smollm2"], num_gpu_blocks=20, swap_space=0.001) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_an_abort_while_in_flight_leaves_the_others_hfs_tokens(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(6, lo=3, hi=30, seed=9)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with _queued(model_dir) as llm:
        core = llm.engine.core
        for i, p in enumerate(prompts):
            core.add_request(core.make_request(f"r{i}", p, params))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        aborted = None
        while core.has_unfinished():
            for o in core.step():
                got[o.request_id] += o.new_token_ids
            if aborted is None and len(got["r1"]) >= 3:
                in_flight = [s.request.request_id for s in core.stepper.queue[0].out.scheduled]
                aborted = in_flight[0]
                assert core.abort([aborted])
                cut = len(got[aborted])
        assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
    assert aborted is not None and len(got[aborted]) == cut
    for i, e in enumerate(expected):
        rid = f"r{i}"
        if rid != aborted:
            assert got[rid] == e[:MAX_NEW]


def test_pp2_batch_queue_equals_synchronous_one_process_as_requests_end_every_way(tiny_model_dirs):
    """The async-scheduling suite's requests (EOS under min_tokens, stop tokens, penalties, logprobs, prompt
    logprobs, aborts): the queue supersedes async scheduling, so no id is fed device to device."""
    expected = synchronous_one_process(tiny_model_dirs["llama"])
    got, num_fed = generate(tiny_model_dirs["llama"], async_scheduling=True, pipeline_parallel_size=2,
                            pipeline_batch_queue=True)
    assert got == expected
    assert num_fed == 0


def test_pp2_batch_queue_constrained_outputs_equal_one_process(smollm2_dir):
    """Structured outputs: each micro-batch's grammar masks are filled from every token its requests sampled."""
    so = StructuredOutputs(regex=r"[A-Z][a-z]{1,6} [0-9]{2}")
    params = [SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=so),
              SamplingParams(temperature=0.0, max_tokens=12)] * 3
    prompts = [f"Name a city and a number, request {i}:" for i in range(len(params))]
    got = {}
    for pp in (1, 2):
        with LLM(model=str(smollm2_dir), max_model_len=256, device="cpu", pipeline_parallel_size=pp,
                 pipeline_batch_queue=pp > 1) as llm:
            got[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if pp == 2:
                assert llm.engine.core.stepper.max_in_flight == 2
                texts = [o.outputs[0].text for o in llm.generate(prompts[:1], params[:1])]
                assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", texts[0]), texts
    assert got[2] == got[1]


def test_a_stage_killed_with_micro_batches_in_flight_ends_the_engine(tiny_model_dirs):
    before = children()
    check_a_killed_rank_ends_the_engine(_queued(tiny_model_dirs["llama"]), "pipeline", before)
