"""Warm-up on the CPU (shared/engine/warmup.py): the shapes it plans are the ones the scheduler really
produces (every chunk bucket, a chunk after a prefix, mixed prefill + decode, every decode batch
bucket), and the engine afterwards is as it was: no block allocated, nothing in the prefix cache, no
request, sampler or block-table state left. tests/gpu/test_warmup_gpu.py checks on the H200 that
nothing compiles or captures after it."""

import logging

import pytest

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine.cuda_graphs import capture_sizes
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.warmup import plan, token_counts, warm_up
from tests.conftest import make_tiny_model

BUDGET, MAX_LEN, MAX_SEQS = 64, 128, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("warmup") / "llama")


def _core(model_dir, hold_finished_kv: bool = False) -> EngineCore:
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_LEN),
                          cache=CacheConfig(num_gpu_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET),
                          device="cpu")
    return EngineCore(config, hold_finished_kv=hold_finished_kv)


def _record_steps(core: EngineCore) -> list[list[tuple[int, int]]]:
    """Each executed step as [(tokens computed before it, new tokens)] per scheduled request, read
    before the scheduler advances them."""
    steps: list[list[tuple[int, int]]] = []
    execute = core.runner.execute

    def spy(out):
        steps.append([(sr.request.num_computed_tokens, sr.num_new_tokens) for sr in out.scheduled])
        return execute(out)

    core.runner.execute = spy
    return steps


class _Counting:
    """Stands in for the worker's step lock: counts how often warm-up takes it."""

    entered = 0

    def __enter__(self) -> None:
        self.entered += 1

    def __exit__(self, *exc) -> None:
        return None


def _assert_untouched(core: EngineCore) -> None:
    bm, sched = core.block_manager, core.scheduler
    assert bm.num_used == 0 and bm.num_free_blocks == bm.num_blocks
    assert not bm.cached and all(h is None for h in bm.block_hash)  # no warm-up prompt in the prefix cache
    assert not bm.req_blocks and not bm.req_hashes and not bm.req_cache_done
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    assert not sched.has_unfinished() and sched.num_held == 0 and not sched.tenant_counters
    assert len(core.runner._tables) == 0 and not core._prompt_logprobs
    assert not core.runner.sampler._generators and not core.runner.sampler._shared  # --seed's stream unmoved


def test_token_counts_cover_each_token_count_class():
    sizes = token_counts(2048, 4094)
    assert sizes[0] == 1 and sizes[-1] == 2048 and 2047 in sizes
    assert {16, 32, 64, 128, 256, 512, 1024} <= set(sizes)
    assert any(s % 16 and s > 1 for s in sizes)
    assert token_counts(64, 20) == [1, 3, 7, 16, 19, 20]  # capped by the longest prompt


def test_full_warmup_runs_every_shape_the_scheduler_makes_and_leaves_the_engine_as_it_was(model_dir, caplog):
    core = _core(model_dir)
    steps = _record_steps(core)
    n = len(plan(core))
    with caplog.at_level(logging.INFO, logger="kvrelay.shared.engine.warmup"):
        assert warm_up(core) == n
    assert f"warming up: {n}/{n} shapes" in caplog.text  # progress, the last line at least
    prefill_sizes = {n for step in steps for done, n in step if n > 1 and done == 0}
    assert set(token_counts(BUDGET, MAX_LEN - 4)) - {1} <= prefill_sizes
    prompts_per_prefill = {len(step) for step in steps if all(n > 1 and done == 0 for done, n in step)}
    assert {1, 2, 3} <= prompts_per_prefill and MAX_SEQS in prompts_per_prefill
    assert any(done > 0 and n > 1 for step in steps for done, n in step), "no chunk after a cached prefix"
    assert any({n == 1 for _, n in step} == {True, False} for step in steps), "no mixed prefill + decode step"
    decode_batches = {len(step) for step in steps if all(n == 1 and done > 0 for done, n in step)}
    assert set(capture_sizes(MAX_SEQS)) <= decode_batches
    _assert_untouched(core)


def test_prefill_worker_warmup_releases_held_kv_and_never_decodes(model_dir):
    core = _core(model_dir, hold_finished_kv=True)
    steps = _record_steps(core)
    hold = _Counting()
    assert warm_up(core, decode=False, hold=hold) == hold.entered > 0  # the step lock, once per shape
    assert steps and not any(done > 0 and n == 1 for step in steps for done, n in step)
    _assert_untouched(core)


def test_where_nothing_compiles_nothing_runs(model_dir):
    core = _core(model_dir)
    steps = _record_steps(core)
    assert warm_up(core, compiles=False) == 0 and steps == []
    _assert_untouched(core)
