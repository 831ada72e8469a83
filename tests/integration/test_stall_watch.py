"""A rank stopped with SIGSTOP hangs rather than dies: rank 0 waits in a collective that never completes, and no
rank exits for the group's watchdog to see. The worker's stall watch (shared/worker/stall_watch.py) takes the
group down once a step of the loop has waited its timeout: the step raises ``TensorParallelError`` naming the
stopped rank, the rank is gone, and the engine stays down. Real rank processes over gloo; the host the watch
reads is the worker's step lock and one slot. A step nothing can interrupt ends the worker: unregistered, then
the process ends (a recorder stands in for ``os._exit`` here; tests/e2e/test_slow_step.py ends a real one)."""

import os
import signal
import threading
from types import SimpleNamespace

import psutil
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.ranks.group import TensorParallelError
from kvrelay.shared.worker import stall_watch, step_lock
from kvrelay.shared.worker.stall_watch import STUCK_EXIT_CODE, StallWatch
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
    ended = []
    watch = threading.Thread(target=StallWatch(host, timeout_s=1.0, leave=lambda: None, end_process=ended.append).run,
                             args=(stop,))
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
    assert ended == []  # the step returned (raised): the worker ends its own way
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


def test_a_step_within_the_timeout_is_left_alone_and_one_without_ranks_ends_the_worker(caplog):
    core = _CoreWithoutRanks()
    host = SimpleNamespace(lock=StepLock(), slots={"m": SimpleNamespace(instance="m", core=core)})
    done = []
    watch = StallWatch(host, timeout_s=3600.0, leave=lambda: done.append("left"), end_process=done.append)
    with host.lock.turn():
        watch.check()
    assert core.asked == [] and done == []
    with host.lock.turn():
        host.lock.turn_since -= 7200  # a step that began two hours ago
        watch.check()
        watch.check()  # once
    assert len(core.asked) == 1
    assert done == ["left", STUCK_EXIT_CODE]  # unregistered first, then the process ends
    assert "nothing can interrupt it" in caplog.text


def test_a_step_whose_groups_went_down_and_that_still_does_not_return_ends_the_worker(monkeypatch):
    core = _CoreWithoutRanks()
    core.abandon_ranks = lambda waited_s: True  # its group goes down, and yet the step goes on
    host = SimpleNamespace(lock=StepLock(), slots={"m": SimpleNamespace(instance="m", core=core)})
    done = []
    watch = StallWatch(host, timeout_s=3600.0, leave=lambda: done.append("left"), end_process=done.append)
    now = [0.0]
    monkeypatch.setattr(stall_watch, "time", SimpleNamespace(monotonic=lambda: now[0]))
    with host.lock.turn():
        host.lock.turn_since = 0.0
        now[0] = 3600.0
        watch.check()
        assert done == []  # the step is given the time to raise
        now[0] = 7200.0
        watch.check()
    assert done == ["left", STUCK_EXIT_CODE]


def test_a_loop_kept_from_its_turn_past_the_timeout_ends_the_worker(monkeypatch):
    """Another thread (a model load on CUDA) holds the step lock and does not let go."""
    host = SimpleNamespace(lock=StepLock(), slots={})
    done = []
    watch = StallWatch(host, timeout_s=3600.0, leave=lambda: done.append("left"), end_process=done.append)
    now = [0.0]
    monkeypatch.setattr(stall_watch, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(step_lock, "time", SimpleNamespace(monotonic=lambda: now[0]))
    holding, release = threading.Event(), threading.Event()

    def load() -> None:
        with host.lock:
            holding.set()
            release.wait(120)

    def loop() -> None:
        with host.lock.turn():
            pass

    loader = threading.Thread(target=load)
    loader.start()
    holding.wait(60)
    turn = threading.Thread(target=loop)
    turn.start()
    while host.lock.wait_since is None:  # the loop waits for its turn
        turn.join(0.01)
    watch.check()
    assert done == []
    now[0] = 3600.0
    watch.check()
    release.set()
    loader.join(60)
    turn.join(60)
    assert done == ["left", STUCK_EXIT_CODE]
