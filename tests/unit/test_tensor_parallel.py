"""Tensor parallelism in real processes over gloo: two ranks give HF transformers' greedy tokens (fp32) on
llama (GQA), gpt2 and bloom, and the same logprobs as one rank; a rank killed with -9 makes the engine
raise promptly and leaves no process behind; sizes the ranks cannot split fail before anything starts."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from kvrelay import LLM
from kvrelay.shared.engine.ranks.group import TensorParallelError
from tests.unit.parallel_ranks import (
    check_a_killed_rank_ends_the_engine,
    check_swap_preemption_equals_hf,
    check_two_ranks_equal_hf_and_one,
    parallel_llm,
)
from tests.unit.parallel_ranks import children as _children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _llm(model_dir, tp: int, **kwargs) -> LLM:
    return parallel_llm(model_dir, tensor_parallel_size=tp, **kwargs)


# qwen2: q/k/v biases sliced with their heads; smollm2: the LM head is the vocab-parallel embedding (tied)
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom", "qwen2", "smollm2"])
def test_tp2_greedy_equals_hf_and_tp1(tiny_model_dirs, arch):
    check_two_ranks_equal_hf_and_one(tiny_model_dirs[arch], "tensor_parallel_size")


def test_tp2_swap_preemption_equals_hf(tiny_model_dirs):
    """Preemption by swap: every rank copies its own heads' blocks out to the host and back."""
    check_swap_preemption_equals_hf(tiny_model_dirs["llama"], "tensor_parallel_size")


def test_killed_rank_fails_the_engine_promptly_and_leaves_no_process(tiny_model_dirs):
    before = _children()
    check_a_killed_rank_ends_the_engine(_llm(tiny_model_dirs["llama"], 2), "tensor", before)


def test_rank_killed_while_starting_fails_the_constructor_promptly(tiny_model_dirs):
    before = _children()
    killed: list[int] = []

    def kill_the_first_rank() -> None:
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for pid in _children() - before:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_first_rank)
    killer.start()
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="did not form: tensor-parallel rank 1 of 2 .* killed by signal 9"):
        _llm(tiny_model_dirs["llama"], 2)
    killer.join()
    assert time.monotonic() - started < 30  # not the rendezvous timeout
    assert _children() == before


@pytest.mark.parametrize("started_by", ["main thread", "loading thread"])
def test_ranks_exit_when_rank_0_is_killed(tiny_model_dirs, started_by):
    """Started by rank 0's main thread, a rank dies with it (the kernel's parent-death signal); started by
    another thread (a worker loading a model), it outlives that thread and notices rank 0 is gone while idle."""
    script = f"""
import os, signal, threading
from kvrelay import LLM, SamplingParams
made = []
def make():
    made.append(LLM(model={str(tiny_model_dirs["llama"])!r}, dtype="float32", max_model_len=128,
                    tensor_parallel_size=2))
if {started_by == "main thread"}:
    make()
else:
    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
made[0].generate({{"prompt_token_ids": [1, 2, 3]}}, SamplingParams(max_tokens=2))  # the group outlives its starter
print(*made[0].engine.core.runner.ranks.pids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived rank 0"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_shutdown_stops_the_ranks(tiny_model_dirs):
    before = _children()
    llm = _llm(tiny_model_dirs["gpt2"], 2)
    assert len(_children() - before) == 1
    llm.shutdown()
    assert _children() == before


def test_sizes_the_ranks_cannot_split_fail_before_any_process_starts(tiny_model_dirs):
    before = _children()
    # the tiny models have 4 attention heads (llama: 2 KV heads)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the attention heads 4"):
        _llm(tiny_model_dirs["llama"], 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 does not divide the attention heads 4"):
        _llm(tiny_model_dirs["bloom"], 8)
    with pytest.raises(ValueError, match="argument --tensor-parallel-size: Input should be greater than or equal to 1"):
        _llm(tiny_model_dirs["gpt2"], 0)
    assert _children() == before


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the devices")
def test_more_ranks_than_cuda_devices_fails_before_anything_loads(tiny_model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs CUDA devices 0..1; this machine has"):
        _llm(tiny_model_dirs["llama"], 2, device="cuda")
