"""Async scheduling (shared/engine/async_step.py) gives exactly the outputs of synchronous stepping.

Each test runs the real engine on a tiny random llama twice, ``async_scheduling`` off and on, over a mix
of requests that ends them every way (EOS under min_tokens, stop tokens, stop strings, max_tokens,
aborts) and samples every way (greedy, seeded, logprobs, penalties, n > 1, prompt logprobs), under
chunked prefill, prefix caching and forced preemption, and compares every field of every output.
"""

import argparse
import dataclasses
import re

import pytest

from kvrelay.cli_args import add_engine_args, engine_config_from_args
from kvrelay.llm import LLM
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.engine.cuda_graphs import DecodeGraphs
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.outputs import Logprob
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.conftest import random_prompts

EOS = 2  # the tiny checkpoints' eos_token_id


class Preemptions:
    """An engine observer counting preemptions, so a test knows its small pool really preempted."""

    def __init__(self) -> None:
        self.count = 0

    def on_step(self, started, out, finished) -> None:
        self.count += len(out.preempted)

    def on_removed(self, requests) -> None:
        pass


def mixed_params() -> list[SamplingParams]:
    stops = list(range(100, 140))  # ~8% of the vocabulary: most requests meet one within a few tokens
    return [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=stops),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7, max_tokens=18, stop_token_ids=stops),
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=3),
        # EOS made likely but banned for 4 tokens: ends right at min_tokens, which counts the unread token
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4, logit_bias={EOS: 30.0}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, min_tokens=2, logit_bias={EOS: 4.0}, logprobs=1),
        SamplingParams(temperature=0.8, seed=11, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2),
        # four favoured tokens that strong penalties rotate: counting the token sampled a step
        # ago (still unread) decides which comes next
        SamplingParams(temperature=0.0, max_tokens=12, logit_bias=dict.fromkeys(range(300, 304), 25.0),
                       frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, seed=5, n=3, max_tokens=10, stop_token_ids=stops),
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def make_llm(model_dir, async_scheduling: bool, graphs: bool = False, **kwargs) -> LLM:
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, async_scheduling=async_scheduling,
              **kwargs)
    if graphs:  # decode steps through the CUDA-graph static input buffer (no recording on the CPU)
        runner = llm.engine.core.runner
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, llm.engine.config.scheduler.max_num_seqs,
                                     runner.max_model_len, runner.block_size, record=False, short_context=40)
        assert runner.graphs.capture()
        runner.enforce_eager = False
    llm.engine.core.observer = Preemptions()
    return llm


def snapshot(outputs) -> list:
    """Everything a caller sees of a finished request but its prefix-cache hits, which depend on when it
    was admitted (a request that ended on a token read a step late held its batch slot and budget one
    step longer), as they do between two synchronous runs that differ in arrival times."""
    return [(o.request_id, o.prompt_token_ids, o.prompt_logprobs, o.num_cached_tokens > 0,
             [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
              for c in o.outputs]) for o in outputs]


def split_floats(value, floats: list[float]):
    """``value`` with each float (logprobs) taken out into ``floats``, so everything else compares exactly."""
    if isinstance(value, float):
        floats.append(value)
        return "<float>"
    if isinstance(value, Logprob):
        return split_floats(dataclasses.astuple(value), floats)
    if isinstance(value, dict):
        return [(k, split_floats(v, floats)) for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [split_floats(v, floats) for v in value]
    return value


def assert_same(async_: list, sync: list) -> None:
    """Token ids, texts, finish and stop reasons, cache hits and logprob ranks/keys exactly; logprob values
    to float32 rounding. Those are not bit-equal, and need not be: a request ending on a token the host
    reads a step late has its row in one more step, which can shift the next chunk boundary of a prompt,
    and a chunk boundary moves the last bits of a prompt's attention (as different traffic does)."""
    got, want = [], []
    assert split_floats(async_, got) == split_floats(sync, want)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def both_ways(model_dir, prompts, params, graphs: bool = False, **kwargs) -> tuple[list, list, LLM]:
    results = []
    for on in (False, True):
        llm = make_llm(model_dir, on, graphs, **kwargs)
        results.append(snapshot(llm.generate(prompts, params)))
    return results[0], results[1], llm


def prompt_mix(n: int, seed: int, shared_prefix: int = 0) -> list[dict]:
    prefix = random_prompts(1, lo=shared_prefix, hi=shared_prefix, seed=99)[0] if shared_prefix else []
    return [{"prompt_token_ids": prefix + p} for p in random_prompts(n, lo=3, hi=50, seed=seed)]


SETUPS = {
    # long prompts split into 24-token chunks next to running decodes; prompts share 2 cached blocks
    "chunked_prefix_cache": dict(max_num_batched_tokens=24, block_size=8, shared_prefix=17),
    # a pool of 18 blocks of 8 (a request needs up to 10) for 26 sequences: preempted and recomputed over and over
    "preempt_recompute": dict(num_gpu_blocks=18, block_size=8, enable_prefix_caching=False),
    "preempt_swap": dict(num_gpu_blocks=18, block_size=8, swap_space=0.01),
    "cuda_graph_buffers": dict(graphs=True, max_num_seqs=8),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_outputs_identical_with_async_scheduling(tiny_model_dirs, setup):
    kwargs = dict(SETUPS[setup])
    params = mixed_params()
    prompts = prompt_mix(2 * len(params), seed=len(setup), shared_prefix=kwargs.pop("shared_prefix", 0))
    if "num_gpu_blocks" in kwargs:  # each request alone must fit the small pool: prompt + max_tokens
        prompts = [{"prompt_token_ids": p["prompt_token_ids"][:60]} for p in prompts]
    sync, async_, llm = both_ways(tiny_model_dirs["llama"], prompts, params * 2, **kwargs)
    assert_same(async_, sync)
    stepper = llm.engine.core.stepper
    assert stepper.num_fed > 0  # decode tokens really went device -> device
    if kwargs.get("graphs"):
        assert llm.engine.core.runner.graphs.num_replays > 0
    reasons = {c[5] for o in sync for c in o[4]}
    assert reasons == {"stop", "length"}
    if "num_gpu_blocks" in kwargs:
        assert llm.engine.core.observer.count > 0
    if "shared_prefix" in SETUPS[setup]:
        assert any(o[3] for o in sync)  # prefix-cache hits, equal in both modes


def test_stop_strings_identical(tiny_model_dirs, smollm2_dir):
    # a real tokenizer detokenizes the tiny model's ids, so stop strings can match mid-stream; each
    # request stops on a piece of its own synchronous text, found by a first run without stops
    model_dir, prompts = tiny_model_dirs["llama"], prompt_mix(6, seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    texts = [o.outputs[0].text for o in make_llm(model_dir, False, tokenizer=str(smollm2_dir)).generate(prompts, plain)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[t[len(t) // 2:len(t) // 2 + 2]])
              for t in texts]
    sync, async_, _ = both_ways(model_dir, prompts, params, tokenizer=str(smollm2_dir))
    assert_same(async_, sync)
    assert sum(c[6] is not None and isinstance(c[6], str) for o in sync for c in o[4]) >= 3


def run_with_aborts(model_dir, async_scheduling: bool) -> dict[str, list[int]]:
    """Requests aborted once they have shown 2 + i tokens (as a client that hangs up reads them)."""
    llm = make_llm(model_dir, async_scheduling, max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompt_mix(6, seed=5)]
    seen: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step(delta=True):
            seen[out.request_id] += out.outputs[0].token_ids
        for i, rid in enumerate(ids):
            if i % 2 == 0 and len(seen[rid]) >= 2 + i and rid in engine.processor.requests:
                engine.abort(rid)
    assert engine.core.block_manager.num_used == 0  # the aborted requests' blocks came back
    return seen


def test_aborts_mid_stream_identical(tiny_model_dirs):
    sync = run_with_aborts(tiny_model_dirs["llama"], False)
    assert run_with_aborts(tiny_model_dirs["llama"], True) == sync
    assert sorted(len(t) for t in sync.values()) == [2, 4, 6, 24, 24, 24]


def test_flag_and_roles(tiny_model_dirs):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config, _, _ = engine_config_from_args(parser.parse_args(
        ["--model", str(tiny_model_dirs["llama"]), "--async-scheduling", "--device", "cpu"]))
    assert config.async_scheduling
    auto, _, _ = engine_config_from_args(parser.parse_args(["--model", str(tiny_model_dirs["llama"]), "--device", "cpu"]))
    config_off, _, _ = engine_config_from_args(parser.parse_args(
        ["--model", str(tiny_model_dirs["llama"]), "--no-async-scheduling", "--device", "cpu"]))
    assert auto.async_scheduling is None and config_off.async_scheduling is False
    assert EngineCore(config).stepper is not None
    assert EngineCore(config_off).stepper is None
    assert EngineCore(auto).stepper is None  # auto on the CPU: its host is its device, nothing to overlap
    assert EngineCore(auto, hold_finished_kv=True).stepper is None  # auto never asks a prefill engine for it
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineCore(config, hold_finished_kv=True)  # a prefill worker's engine


def test_prefill_worker_refuses_the_flag():
    # its config is refused, before the worker touches Redis or loads a model: one line naming the flag
    engine = EngineConfig(ModelConfig("m"), device="cpu", async_scheduling=True)
    with pytest.raises(ValueError, match=re.escape("argument --async-scheduling: only the decode and unified workers "
                                                   "use it (this is a prefill worker)")):
        WorkerConfig("prefill", engine, model_name="m")


def decode_role(model_dir, async_scheduling: bool) -> dict[str, list]:
    """The decode worker's path: prompts prefilled by a prefill engine (which holds their KV), the KV copied
    into blocks the decode engine reserved, the first token handed over, then decoded to the end."""
    def config(on: bool) -> EngineConfig:
        return EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128), device="cpu",
                            async_scheduling=on)

    prefill, decode = EngineCore(config(False), hold_finished_kv=True), EngineCore(config(async_scheduling))
    stops = list(range(100, 140))
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stops),
              SamplingParams(temperature=0.9, seed=4, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=9, min_tokens=3, logit_bias={EOS: 30.0})]
    seen: dict[str, list] = {}
    for i, p in enumerate(random_prompts(6, lo=5, hi=40, seed=8)):
        rid, sp = f"r{i}", params[i % len(params)]
        prefill.add_request(prefill.make_request(rid, p, SamplingParams(**{**vars(sp), "max_tokens": 1, "min_tokens": 0}), EOS))
        (first,) = [o for _ in range(3) for o in prefill.step() if o.request_id == rid]
        blocks = decode.kv.reserve(rid, len(p))
        held = prefill.kv.block_ids(rid)[:len(blocks)]
        decode.kv.kv_cache[:, :, blocks] = prefill.kv.kv_cache[:, :, held]
        prefill.kv.release_held(rid)
        decode.add_remote_prefilled(decode.make_request(rid, p, sp, EOS), first.new_token_ids[0], 0)
        seen[rid] = [first.new_token_ids[0]]
    while decode.has_unfinished():
        for o in decode.step():
            seen[o.request_id] += [o.new_token_ids, o.new_logprobs, o.finish_reason, o.stop_reason]
    return seen


def test_decode_role_identical(tiny_model_dirs):
    sync = decode_role(tiny_model_dirs["llama"], False)
    assert_same(decode_role(tiny_model_dirs["llama"], True), sync)


def test_serve_gives_async_scheduling_to_the_decode_and_unified_workers_only():
    from kvrelay.cli import build_parser
    from kvrelay.serve_plan import models_to_serve, plan

    def engines(mode: str) -> dict[str, bool]:
        args = build_parser().parse_args(["serve", "--model", "dummy:smollm2-135m", "--mode", mode,
                                          "--async-scheduling"])
        return {c.command: c.config.engine.async_scheduling for c in plan(args, models_to_serve(args), "redis://x")
                if not c.is_gateway}

    assert engines("disaggregated") == {"prefill-worker": None, "decode-worker": True}  # None: the engine decides
    assert engines("unified") == {"unified-worker": True}
