"""A rank stopped with SIGSTOP hangs rather than dies: rank 0 waits in a collective that never completes, and no
rank exits for the group's watchdog to see. The worker's stall watch (shared/worker/stall_watch.py) takes the
group down once a step of the loop has waited its timeout: the step raises ``TensorParallelError`` naming the
stopped rank, the rank is gone, and the engine stays down. Real rank processes over gloo; the host the watch
reads is the worker's step lock and one slot."""

import os
import signal
import threading
from types import SimpleNamespace

import psutil
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.ranks.group import TensorParallelError
from kvrelay.shared.worker.stall_watch import StallWatch
from kvrelay.shared.worker.step_lock import StepLock
from tests.conftest import random_prompts
from tests.unit.parallel_ranks import children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_stopped_rank_s_group_goes_down_once_a_step_waited_the_timeout(tiny_model_dirs):
    before = children()
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    (pid,) = llm.engine.core.runner.ranks.pids
    host = SimpleNamespace(lock=StepLock(), slots={"tiny": SimpleNamespace(instance="tiny", core=llm.engine.core)})
    stop = threading.Event()
    watch = threading.Thread(target=StallWatch(host, timeout_s=1.0).run, args=(stop,))
    watch.start()
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    stream = llm.generate_stream([{"prompt_token_ids": p} for p in random_prompts(4, seed=2)], params)
    try:
        next(stream)  # the group is mid-generation
        os.kill(pid, signal.SIGSTOP)
        stuck = (f"tensor-parallel group of 2 is stuck: a step has waited [0-9.]+ s on its ranks; rank 1 \\(pid {pid}\\) "
                 "is stopped; the group is down")
        with host.lock.turn(), pytest.raises(TensorParallelError, match=stuck):
            for _ in stream:
                pass
    finally:
        stop.set()
        watch.join()
    assert not psutil.pid_exists(pid)  # killed, and reaped by the group
    with pytest.raises(TensorParallelError, match="is stuck"):  # and it stays down
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params)
    llm.shutdown()
    assert children() == before


class _CoreWithoutRanks:
    def __init__(self) -> None:
        self.asked: list[float] = []

    def abandon_ranks(self, waited_s: float) -> bool:
        self.asked.append(waited_s)
        return False


def test_a_step_within_the_timeout_is_left_alone_and_one_without_ranks_is_only_logged(caplog):
    core = _CoreWithoutRanks()
    host = SimpleNamespace(lock=StepLock(), slots={"m": SimpleNamespace(instance="m", core=core)})
    watch = StallWatch(host, timeout_s=3600.0)
    with host.lock.turn():
        watch.check()
    assert core.asked == []
    with host.lock.turn():
        host.lock.turn_since -= 7200  # a step that began two hours ago
        watch.check()
        watch.check()  # once per step
    assert len(core.asked) == 1
    assert "no rank group to take down" in caplog.text
