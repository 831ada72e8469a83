"""One unified worker's loop against a real engine, a real Redis and a real ZMQ socket standing in for the
gateway: the requests that finish in a step are answered before their jobs are ACKed, and their ACKs go to
Redis together, not one round trip each."""

import time

import pytest
import zmq

from kvrelay.shared.wire import job_queue, zmq_auth
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import Job, TokenBatch
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.unified_worker.worker import UnifiedWorker


# and again with async scheduling, whose steps answer a step late: the worker loop must still answer and ACK
@pytest.fixture(params=[[], ["--async-scheduling"]], ids=["sync", "async"])
def worker(redis_url, request):
    from kvrelay.cli import build_parser
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    args = build_parser().parse_args(["unified-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--redis-url", redis_url, "--num-gpu-blocks-override", "64", *request.param])
    config = worker_config("unified", args)
    config.freeze_gc = False  # a test process is not a worker's own
    w = UnifiedWorker(config)
    (slot,) = w.runtime.slots.values()
    assert (slot.core.stepper is not None) == bool(request.param)
    w.attach(slot)  # what runtime.start does, without its threads and signal handlers
    yield w
    w.runtime.shutdown()


def test_a_steps_finished_jobs_are_answered_first_then_acked_in_one_round_trip(worker, monkeypatch):
    (slot,) = worker.runtime.slots.values()
    gateway = zmq.Context.instance().socket(zmq.PULL)
    zmq_auth.serve(gateway, worker.runtime.curve)  # as a gateway's event socket
    reply_addr = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i in range(3):  # same length, admitted together: they finish in the same step
        job = Job(request_id=f"r{i}", model=slot.instance, prompt_token_ids=[3, 4, 5, 6 + i], sampling=params,
                  tenant="t", priority=0, reply_addr=reply_addr, deadline=0.0, arrival=time.time())
        worker.runtime.redis.xadd(keys.prefill_stream(slot.instance), {keys.JOB_FIELD: encode(job)})

    finished: set[str] = set()
    acks: list[tuple[set[str], tuple]] = []  # (requests the gateway had seen finish by then, entry ids ACKed)
    ack = job_queue.JobQueue.ack

    def watched_ack(queue, *entry_ids):
        due = (*queue._unacked, *entry_ids)
        if due:  # what reached the gateway before this ACK (waiting up to 1 s for events in flight)
            while gateway.poll(1000 if len(finished) < len(due) else 0):
                for event in decode(gateway.recv(), TokenBatch).events:
                    if event.finish_reason is not None:
                        finished.add(event.request_id)
            acks.append((set(finished), due))
        return ack(queue, *entry_ids)

    monkeypatch.setattr(job_queue.JobQueue, "ack", watched_ack)
    deadline = time.monotonic() + 60  # does not hang
    while len(worker.inflight) or not acks:
        assert time.monotonic() < deadline
        worker.step()
    gateway.close(linger=0)

    assert len(acks) == 1, f"one ACK round trip for the step's three finished jobs, got {acks}"
    answered, acked = acks[0]
    assert answered == {"r0", "r1", "r2"} and len(acked) == 3
    assert worker.runtime.redis.xpending(keys.prefill_stream(slot.instance), keys.PREFILL_GROUP)["pending"] == 0


def test_a_first_token_says_when_the_read_that_returned_its_job_was_issued(worker):
    """A job queued while the worker is busy (here: before it steps) is read by a read issued after the
    enqueue; the first token's ``fetch_asked`` is that read's issue, between the enqueue and ``fetched``, so
    the gateway can put the wait before it in ``stream_wait`` (gateway/ttft_stages.py)."""
    (slot,) = worker.runtime.slots.values()
    gateway = zmq.Context.instance().socket(zmq.PULL)
    zmq_auth.serve(gateway, worker.runtime.curve)
    reply_addr = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
    job = Job(request_id="r", model=slot.instance, prompt_token_ids=[3, 4, 5], tenant="t", priority=0,
              sampling=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), reply_addr=reply_addr,
              deadline=0.0, arrival=time.time())
    enqueued = time.time()
    worker.runtime.redis.xadd(keys.prefill_stream(slot.instance), {keys.JOB_FIELD: encode(job)})
    time.sleep(0.05)  # the worker is in a step meanwhile
    stepped = time.time()
    first = None
    deadline = time.monotonic() + 60
    while first is None:
        assert time.monotonic() < deadline
        worker.step()
        while gateway.poll(0):
            events = decode(gateway.recv(), TokenBatch).events
            first = first or next((e for e in events if e.token_ids), None)
    gateway.close(linger=0)
    assert first.first_token_times is not None and first.fetch_asked is not None
    assert enqueued < stepped <= first.fetch_asked <= first.first_token_times["fetched"]
