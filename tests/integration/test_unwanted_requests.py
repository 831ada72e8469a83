"""Requests nobody waits for any more are dropped where they enter a worker (a job read from the stream; a
handoff landing on a decode worker), against a real engine and a real Redis: one whose abort came first (an
abort is published once, and a request can still be in the stream or on its way to a decode worker when it
comes), and one whose gateway stopped beating (its jobs still in the stream), so neither holds a seat or KV
blocks."""

import time
from types import SimpleNamespace

import pytest

from kvrelay.decode_worker.worker import DecodeWorker
from kvrelay.shared.handoff.blocks import layout_of
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import KVHeader
from kvrelay.shared.wire.protocol import Abort, Job
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker import gateway_watch, lifecycle
from kvrelay.unified_worker.worker import UnifiedWorker

HANG_S = 60.0  # a hang bound, not a speed claim: what the steps wait for comes within a few of them


def _config(role: str, redis_url: str):
    from kvrelay.cli import build_parser
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    args = build_parser().parse_args([f"{role}-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--redis-url", redis_url, "--num-gpu-blocks-override", "64"])
    config = worker_config(role, args)
    config.freeze_gc = False  # a test process is not a worker's own
    return config


def _job(rid: str, model: str, reply_addr: str = "tcp://127.0.0.1:9", arrival: float | None = None,
         max_tokens: int = 20) -> Job:
    return Job(request_id=rid, model=model, prompt_token_ids=[3, 4, 5, 6], tenant="t", priority=0,
               sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), reply_addr=reply_addr,
               deadline=time.time() + 60, arrival=time.time() if arrival is None else arrival)


def _publish_abort(worker, rid: str) -> None:
    """What a gateway does when a client leaves, received as the worker's listener thread receives it."""
    worker.runtime.redis.publish(keys.ABORT_CHANNEL, encode(Abort(request_ids=[rid], reason="client disconnected")))
    worker.runtime.aborts.ids.put(rid)


@pytest.fixture()
def unified(redis_url):
    w = UnifiedWorker(_config("unified", redis_url))
    (slot,) = w.runtime.slots.values()
    w.attach(slot)  # what runtime.start does, without its threads and signal handlers
    yield w
    w.runtime.shutdown()


@pytest.fixture()
def decode(redis_url):
    w = DecodeWorker(_config("decode", redis_url))
    yield w
    w.sock.close(linger=0)
    w.runtime.shutdown()


def test_a_job_aborted_while_still_in_its_stream_is_answered_and_acked_unrun(unified):
    (slot,) = unified.runtime.slots.values()
    _publish_abort(unified, "gone")
    unified.step()  # the abort arrives while the job waits in the stream: nothing here holds it yet
    redis = unified.runtime.redis
    stream = keys.prefill_stream(slot.instance)
    redis.xadd(stream, {"data": encode(_job("gone", slot.instance))})
    redis.xadd(stream, {"data": encode(_job("kept", slot.instance))})
    unified.step()
    assert not slot.core.is_running("gone")
    assert slot.core.is_running("kept")
    assert "gone" not in unified.inflight
    deadline = time.monotonic() + HANG_S
    while redis.xpending(stream, keys.PREFILL_GROUP)["pending"] != 1 and time.monotonic() < deadline:
        unified.step()
    assert redis.xpending(stream, keys.PREFILL_GROUP)["pending"] == 1  # "gone" ACKed, "kept" running


def test_a_handoff_landing_after_its_abort_frees_its_blocks_unrun(decode):
    (slot,) = decode.runtime.slots.values()
    core = slot.core
    free = core.kv.num_free_blocks
    _publish_abort(decode, "gone")
    decode.step()  # the abort comes while the KV is on its way: nothing here holds the request yet
    job = _job("gone", slot.instance)
    blocks = core.kv.reserve("gone", len(job.prompt_token_ids))
    header = KVHeader(job=job, **layout_of(core.kv.kv_cache), num_blocks=len(blocks), block_ids=blocks,
                      transport="layers", nbytes=0, first_token_id=7, first_logprob=None, first_top_logprobs=None,
                      prompt_logprobs=None, num_cached_tokens=0)
    decode._admit(header)
    assert not core.is_running("gone")
    assert "gone" not in decode.inflight
    assert core.kv.num_free_blocks == free


def test_jobs_of_a_gateway_that_stopped_beating_are_dropped_unrun_unless_it_is_back(unified, monkeypatch):
    # the lifecycle's and the gateway watch's clock is the test's: a loaded box that runs a step slowly does not
    # move a request past its grace (GATEWAY_TTL_S from its arrival) or a key past its confirmation
    now = [time.time()]
    monkeypatch.setattr(lifecycle, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(gateway_watch, "time", SimpleNamespace(monotonic=lambda: now[0]))
    (slot,) = unified.runtime.slots.values()
    rt, redis = unified.runtime, unified.runtime.redis
    dead = "tcp://127.0.0.1:13"
    redis.delete(keys.gateway_key(dead))
    rt.gateways.watch({dead})  # as if it had requests here: the watch finds its key missing, twice
    rt.gateways.check()
    now[0] += gateway_watch.CONFIRM_S
    rt.gateways.check()
    unified.step()  # the loop learns the gateway is gone
    stream = keys.prefill_stream(slot.instance)
    long_ago = now[0] - 60
    redis.xadd(stream, {"data": encode(_job("orphan", slot.instance, dead, long_ago))})
    redis.xadd(stream, {"data": encode(_job("fresh", slot.instance, dead, now[0]))})  # within its grace: kept
    unified.step()
    assert not slot.core.is_running("orphan") and "orphan" not in unified.inflight
    assert slot.core.is_running("fresh")
    redis.set(keys.gateway_key(dead), "gw", ex=60)  # a gateway beating again on that address is alive
    redis.xadd(stream, {"data": encode(_job("back", slot.instance, dead, long_ago))})
    unified.step()
    assert slot.core.is_running("back")
    redis.delete(keys.gateway_key(dead))


def test_a_gateway_whose_process_ended_loses_its_requests_at_once_and_its_later_jobs_unless_one_is_back(unified):
    """Its event connection closed: no waiting out its liveness key, no grace for young requests; its key
    goes (so the other workers find it gone too), and a new gateway process beating there is served."""
    import zmq

    from kvrelay.shared.wire import zmq_auth

    (slot,) = unified.runtime.slots.values()
    rt, redis = unified.runtime, unified.runtime.redis
    gateway = rt.ctx.socket(zmq.PULL)
    gateway.setsockopt(zmq.LINGER, 0)
    zmq_auth.serve(gateway, rt.curve)
    addr = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
    redis.set(keys.gateway_key(addr), "host-1", ex=60)
    stream = keys.prefill_stream(slot.instance)
    redis.xadd(stream, {"data": encode(_job("running", slot.instance, addr, max_tokens=10_000))})
    deadline = time.monotonic() + HANG_S
    while not gateway.poll(0) and time.monotonic() < deadline:
        unified.step()  # until its first events reached the gateway: the connection is up
    assert slot.core.is_running("running")
    gateway.close()  # its process ended
    deadline = time.monotonic() + HANG_S
    # on a loaded box the request may reach max_model_len before the lost connection is seen (LOST_AFTER_S
    # after it closed): that, not the request's end, is what takes the key
    while ("running" in unified.inflight or redis.exists(keys.gateway_key(addr))) and time.monotonic() < deadline:
        unified.step()
    assert "running" not in unified.inflight and not slot.core.is_running("running")
    assert redis.get(keys.gateway_key(addr)) is None  # its liveness key went with it
    redis.xadd(stream, {"data": encode(_job("young", slot.instance, addr))})  # queued just before it died
    unified.step()
    assert "young" not in unified.inflight and not slot.core.is_running("young")
    redis.set(keys.gateway_key(addr), "host-2", ex=60)  # another gateway process on that address
    redis.xadd(stream, {"data": encode(_job("next", slot.instance, addr))})
    unified.step()
    assert slot.core.is_running("next")
    redis.delete(keys.gateway_key(addr))



def test_a_beating_gateway_not_yet_connected_to_is_not_lost(unified):
    """A connection never made (nothing accepts on the address: as for a gateway this loaded box has not
    connected to yet) does not make the gateway lost while its liveness key says it beats; without the key
    it does."""
    from kvrelay.shared.worker import link_watch
    from tests.integration.gateway_harness import free_port

    (slot,) = unified.runtime.slots.values()
    redis, stream = unified.runtime.redis, keys.prefill_stream(slot.instance)
    addrs = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("beats", "silent")}  # nothing listens on either
    redis.set(keys.gateway_key(addrs["beats"]), "host-1", ex=60)
    for name, addr in addrs.items():
        redis.xadd(stream, {"data": encode(_job(name, slot.instance, addr, max_tokens=10_000))})
    deadline = time.monotonic() + HANG_S
    while addrs["silent"] not in unified.inflight.lost_gateways:
        assert time.monotonic() < deadline, "a gateway that never connected and does not beat was not found lost"
        unified.step()
    again = time.monotonic() + 2 * link_watch.LOST_AFTER_S  # dialed as long as the silent one: past its grace
    while time.monotonic() < again:
        unified.step()
    assert addrs["beats"] not in unified.inflight.lost_gateways
    redis.delete(keys.gateway_key(addrs["beats"]))
