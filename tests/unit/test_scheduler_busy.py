"""The scheduler's side of the pipeline batch queue (shared/engine/batch_queue.py): a request in a micro-batch
still in flight (``busy``) is neither scheduled again nor preempted for another's blocks, and ``max_seqs``
spreads the running set over several micro-batches."""

from kvrelay.shared.engine.request import RequestStatus
from tests.unit.scheduler_runner import make, rq, two_growing


def test_a_busy_request_is_never_the_victim_the_one_that_needs_blocks_yields_itself():
    s = make(num_blocks=4, max_model_len=16)
    two_growing(s)  # a needs a new block now; without busy, b (the tail) would be preempted
    a, b = s.running
    out = s.schedule(busy=frozenset({"b"}))
    assert out.preempted == ["a"] and not out.scheduled
    assert b.status is RequestStatus.RUNNING and a.status is RequestStatus.PREEMPTED


def test_busy_requests_are_skipped_and_max_seqs_splits_the_rest():
    s = make()
    for i in range(4):
        s.add_request(rq(f"r{i}", 5, base=10 + 10 * i))
    first = s.schedule(max_seqs=2)
    assert [x.request.request_id for x in first.scheduled] == ["r0", "r1"]
    second = s.schedule(busy=frozenset({"r0", "r1"}), max_seqs=2)
    assert [x.request.request_id for x in second.scheduled] == ["r2", "r3"]
    s.update_from_output(first, {x.request.request_id: [7] for x in first.scheduled})
    third = s.schedule(busy=frozenset({"r2", "r3"}), max_seqs=2)
    assert [(x.request.request_id, x.num_new_tokens) for x in third.scheduled] == [("r0", 1), ("r1", 1)]
