"""How rank 0 cuts a pipeline step into micro-batches: contiguous parts in the scheduler's order, never
empty, at most one per stage, about even in tokens."""

import pytest

from kvrelay import SamplingParams
from kvrelay.shared.engine.ranks.pipe_driver import split
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import ScheduledRequest


def _scheduled(*tokens: int) -> list[ScheduledRequest]:
    return [ScheduledRequest(Request(f"r{i}", [1] * 64, SamplingParams()), n, [0]) for i, n in enumerate(tokens)]


@pytest.mark.parametrize(("tokens", "stages", "want"), [
    ((1, 1, 1, 1), 2, [2, 2]),  # decode rows: halves
    ((1,), 4, [1]),  # one request: one micro-batch, whatever the stages
    ((5, 1), 4, [1, 1]),  # fewer requests than stages: one each
    ((30, 1, 1, 1), 2, [1, 3]),  # a long chunk takes a micro-batch of its own
    ((8, 8, 8, 8, 8, 8), 3, [2, 2, 2]),
    ((1, 1, 1), 1, [3]),
])
def test_split_is_contiguous_and_even(tokens, stages, want):
    scheduled = _scheduled(*tokens)
    parts = split(scheduled, stages)
    assert [len(p) for p in parts] == want
    assert [sr for p in parts for sr in p] == scheduled
