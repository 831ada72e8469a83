"""A decode worker with --decode-step-pace-ms, against a real engine and a real Redis: while KV is on its way
(a grant outstanding) its loop starts a step at most every interval and spends the wait taking handoffs;
with none on its way it steps at once."""

import time
from itertools import pairwise

import pytest

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.decode_worker.worker import DecodeWorker
from kvrelay.shared.handoff.blocks import layout_of
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.handoff import KVHeader
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.sampling_params import SamplingParams

PACE_MS = 250
GATEWAY = "tcp://127.0.0.1:9"  # nobody listens: its liveness key, set below, says it is alive all the same


@pytest.fixture()
def decode(redis_url):
    from kvrelay.cli import build_parser
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    args = build_parser().parse_args(["decode-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--redis-url", redis_url, "--num-gpu-blocks-override", "64",
                                      "--decode-step-pace-ms", str(PACE_MS)])
    config = worker_config("decode", args)
    config.freeze_gc = False  # a test process is not a worker's own
    w = DecodeWorker(config)
    w.runtime.redis.set(keys.gateway_key(GATEWAY), "gw", ex=60)
    yield w
    w.sock.close(linger=0)
    w.runtime.shutdown()


def _land(worker: DecodeWorker, rid: str) -> None:
    """A handed-off request joins the batch, as the receiver admits one whose KV landed."""
    (slot,) = worker.runtime.slots.values()
    job = Job(request_id=rid, model=slot.instance, prompt_token_ids=[3, 4, 5, 6], tenant="t", priority=0,
              sampling=SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
              reply_addr=GATEWAY, deadline=time.time() + 60, arrival=time.time())
    blocks = slot.core.kv.reserve(rid, len(job.prompt_token_ids))
    worker._admit(KVHeader(job=job, **layout_of(slot.core.kv.kv_cache), num_blocks=len(blocks), block_ids=blocks,
                           transport="layers", nbytes=0, first_token_id=7, first_logprob=None,
                           first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0))


def test_steps_are_paced_only_while_kv_is_on_its_way(decode, monkeypatch):
    arriving = [False]
    monkeypatch.setattr(HandoffReceiver, "busy", property(lambda self: arriving[0]))
    waits: list[int] = []
    poll = decode.receiver.poll
    monkeypatch.setattr(decode.receiver, "poll", lambda ms, admit: (waits.append(ms), poll(ms, admit))[1])
    _land(decode, "r1")
    for _ in range(3):
        decode.step()
    assert waits == [0, 0, 0]  # nothing on its way: no step waits for the one before's interval

    arriving[0] = True
    starts = []
    for _ in range(3):
        waits.clear()
        decode.step()
        starts.append(decode.pace.last_start)
        assert all(0 <= ms <= PACE_MS for ms in waits)
    # each step began at least an interval after the one before it
    assert all(b - a >= PACE_MS / 1000 for a, b in pairwise(starts))
    (slot,) = decode.runtime.slots.values()
    assert slot.core.is_running("r1")

    _land(decode, "r2")  # a handoff taken during a paced wait joins the next step
    decode.step()
    assert slot.core.is_running("r2")
