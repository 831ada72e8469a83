"""A real unified worker (SmolLM2 engine, CPU, real Redis, a real ZMQ socket standing in for the gateway) served
under --scheduling-policy priority with one sequence at a time: of a backlog queued where the gateway queues it
before the worker's first read, the best band's job runs first, the default band's in arrival order after it,
the worse band's last. Before priority bands, the worker took the default band's jobs first, in arrival order,
whatever the priority of a job queued later."""

import time

import pytest
import zmq

from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.priority_bands import job_stream
from kvrelay.shared.wire.protocol import Job, TokenBatch
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.unified_worker.worker import UnifiedWorker

HANG_BOUND_S = 300  # a hang bound, not a speed claim


@pytest.fixture()
def worker(redis_url, smollm2_dir):
    from kvrelay.cli import build_parser
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    args = build_parser().parse_args(["unified-worker", "--model", str(smollm2_dir), "--device", "cpu",
                                      "--redis-url", redis_url, "--max-model-len", "256", "--skip-warmup",
                                      "--scheduling-policy", "priority", "--max-num-seqs", "1",
                                      "--reclaim-idle-ms", str(HANG_BOUND_S * 1000)])
    config = worker_config("unified", args)
    config.freeze_gc = False  # a test process is not a worker's own
    w = UnifiedWorker(config)
    (slot,) = w.runtime.slots.values()
    w.attach(slot)  # what runtime.start does, without its threads and signal handlers; it reads nothing yet
    yield w
    w.runtime.shutdown()


def test_a_backlog_is_taken_best_priority_first(worker, smollm2_dir):
    (slot,) = worker.runtime.slots.values()
    prompt = load_tokenizer(smollm2_dir).encode("The capital of France is")
    gateway = zmq.Context.instance().socket(zmq.PULL)
    zmq_auth.serve(gateway, worker.runtime.curve)
    reply_addr = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
    backlog = [("default0", 0), ("worse", 4), ("default1", 0), ("high", -1)]  # in the order they arrive
    for rid, priority in backlog:
        job = Job(request_id=rid, model=slot.instance, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2),
                  tenant="t", priority=priority, reply_addr=reply_addr, deadline=0.0, arrival=time.time())
        worker.runtime.redis.xadd(job_stream(slot.instance, priority, "priority"), {keys.JOB_FIELD: encode(job)})

    expected = ["high", "default0", "default1", "worse"]
    finished: list[str] = []
    deadline = time.monotonic() + HANG_BOUND_S
    while len(finished) < len(expected):
        assert time.monotonic() < deadline, finished
        worker.step()
        while gateway.poll(0):
            for event in decode(gateway.recv(), TokenBatch).events:
                if event.finish_reason is not None:
                    assert event.finish_reason == "length", event
                    finished.append(event.request_id)
                    assert finished == expected[:len(finished)]  # one at a time: finished in the order taken
    gateway.close(linger=0)
