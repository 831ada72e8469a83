"""What the tensor- and pipeline-parallel engine tests share: this process's live children, and the check
that a rank killed with -9 mid-generation ends the engine promptly, for good, and leaves no process."""

import os
import signal
import time

import psutil
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.ranks.group import TensorParallelError
from tests.conftest import random_prompts


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def check_a_killed_rank_ends_the_engine(llm: LLM, kind: str, before: set[int]) -> None:
    """``kind``: "tensor" or "pipeline", as the error names the rank."""
    (pid,) = llm.engine.core.runner.ranks.pids
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    stream = llm.generate_stream([{"prompt_token_ids": p} for p in random_prompts(4, seed=2)], params)
    next(stream)  # the group is mid-generation
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=f"{kind}-parallel rank 1 of 2 \\(pid {pid}\\) was killed by signal 9"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    with pytest.raises(TensorParallelError, match="the group is down"):  # and it stays down
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params)
    llm.shutdown()
    assert children() == before
