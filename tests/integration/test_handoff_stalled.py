"""A prefill worker asks no decode worker whose heartbeat says its engine loop has been in one step past
--stalled-step-timeout-s (prefill_worker/handoff.py). The decode workers are heartbeat records in a real Redis,
which the HandoffManager reads as a prefill worker's does, naming real sockets: a decode side of
tests/integration/handoff_harness.py, or a socket nobody answers on, as a decode worker's while its step hangs."""

import logging
import time

import pytest
import redis
import torch
import zmq

from kvrelay.prefill_worker import handoff
from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State, Transfer
from kvrelay.prefill_worker.worker import PrefillWorker
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.handoff.standalone import decode_info, endpoint, synthetic_job
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.handoff_harness import BLOCK, MODEL, SHAPE, early, peer_router, poll_until
from tests.integration.model_pool_harness import own_db
from tests.zmq_secret import CURVE

STALLED_AFTER_S = 5.0
NUM_TOKENS = 2 * BLOCK


@pytest.fixture()
def registry(redis_url):
    r = sync_client(own_db(redis_url, 10))
    r.flushdb()
    yield r
    r.flushdb()


@pytest.fixture()
def prefill_of(registry):
    """``make(timeout_s)``: a prefill side whose decode workers are those registered in ``registry``; and its
    endpoint."""
    rt = endpoint(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)), "p1", MODEL)
    rt.redis = registry
    ctx = zmq.Context()
    managers = []

    def make(timeout_s: float) -> HandoffManager:
        managers.append(HandoffManager(ctx, rt, timeout_s, curve=CURVE, stalled_step_timeout_s=STALLED_AFTER_S))
        return managers[-1]

    yield rt, make
    for m in managers:
        m.close()
    ctx.destroy(linger=0)


def register(r: redis.Redis, worker_id: str, addr: str, step_age_s: float = 0.0, free_blocks: int = 64) -> None:
    """A decode worker's heartbeat, as shared/worker/registration.py publishes it."""
    info = decode_info(addr, MODEL, worker_id)
    info.free_blocks, info.total_blocks, info.step_age_s, info.heartbeat = free_blocks, free_blocks, step_age_s, \
        time.time()
    r.set(keys.worker_key(worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
    r.sadd(keys.WORKERS_INDEX, worker_id)


def prefilled(rt, manager: HandoffManager, rid: str) -> Transfer:
    """Hand off a prompt whose prefill finished (its blocks held, its first token known)."""
    assert rt.core.kv.reserve(rid, NUM_TOKENS) is not None
    return manager.start(synthetic_job(rid, NUM_TOKENS, MODEL), rid.encode(), FirstToken(2))


def test_a_stalled_decode_worker_beside_one_that_steps_is_not_asked(registry, prefill_of, decode_side):
    """The stalled one has the most free KV, which would make it the first asked."""
    rt, make = prefill_of
    stuck, stuck_addr = peer_router()
    side = decode_side()
    register(registry, "d-stuck", stuck_addr, step_age_s=2 * STALLED_AFTER_S, free_blocks=1000)
    register(registry, "d-ok", side.addr)
    manager = make(timeout_s=60.0)  # an ask the stuck one never answers would hold the transfer past the test
    t = prefilled(rt, manager, "r")
    assert t.target == side.addr, f"asked {t.target}"
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [e.state for e in ended] == [State.DONE], ended[0].reason
    assert t.tried == {"d-ok"} and "r" in side.admitted
    assert not stuck.poll(0), "the stalled worker was asked"
    stuck.close()


def test_with_only_stalled_decode_workers_the_transfer_fails_at_its_timeout_naming_them(registry, prefill_of):
    rt, make = prefill_of
    stuck, stuck_addr = peer_router()
    register(registry, "d-stuck", stuck_addr, step_age_s=2 * STALLED_AFTER_S)
    manager = make(timeout_s=1.0)
    t = prefilled(rt, manager, "r")
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff's end")
    assert ended == [t] and t.state is State.FAILED and not t.target_lost
    assert t.reason.startswith("no decode worker for this model; stalled: d-stuck (its engine has been "
                               "in one step for 10 s, over --stalled-step-timeout-s 5)"), t.reason
    assert not stuck.poll(0), "the stalled worker was asked"
    stuck.close()


def test_a_stalled_decode_worker_is_asked_once_it_steps_again(registry, prefill_of, decode_side):
    """Until then the transfer keeps its KV and looks again, as for a decode worker being replaced."""
    rt, make = prefill_of
    side = decode_side()
    register(registry, "d1", side.addr, step_age_s=2 * STALLED_AFTER_S)
    manager = make(timeout_s=60.0)
    t = prefilled(rt, manager, "r")
    poll_until(manager, lambda: t.rounds_refused >= 2 or t.target, "two rounds with no decode worker to ask")
    assert t.state is State.GRANT_WAIT and t.target == "" and not side.receiver.grants
    register(registry, "d1", side.addr, step_age_s=0.0)
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [e.state for e in ended] == [State.DONE], ended[0].reason
    assert t.target == side.addr and "r" in side.admitted


def test_a_stall_is_logged_once_when_it_begins_and_once_when_it_ends_not_per_request(registry, prefill_of, decode_side,
                                                                                     caplog, monkeypatch):
    monkeypatch.setattr(handoff, "WORKER_CACHE_S", 0.0)  # every choice of a decode worker reads the registry
    rt, make = prefill_of
    side = decode_side()
    register(registry, "d1", side.addr, step_age_s=2 * STALLED_AFTER_S)
    manager = make(timeout_s=60.0)
    with caplog.at_level(logging.INFO, logger=handoff.__name__):
        transfers = [prefilled(rt, manager, f"r{i}") for i in range(3)]  # three requests, each a read, one stall
        poll_until(manager, lambda: all(t.rounds_refused >= 2 for t in transfers), "two rounds of each refused")
        register(registry, "d1", side.addr, step_age_s=0.0)
        ended = poll_until(manager, lambda: not manager.transfers, "the handoffs")
    assert [e.state for e in ended] == [State.DONE] * 3, [e.reason for e in ended]
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == handoff.__name__]
    assert [level for level, _ in lines] == ["WARNING", "INFO"], lines
    assert lines[0][1].startswith("decode worker 'd1' is stalled (its engine has been in one step for 10 s, over "
                                  "--stalled-step-timeout-s 5)"), lines
    assert lines[1][1].startswith("decode worker 'd1' steps again"), lines


def test_an_early_ask_with_only_stalled_decode_workers_waits_for_the_prefill(registry, prefill_of):
    """An ask before the prompt's last chunk goes nowhere: it is made again once the prompt is computed."""
    rt, make = prefill_of
    stuck, stuck_addr = peer_router()
    register(registry, "d-stuck", stuck_addr, step_age_s=2 * STALLED_AFTER_S)
    manager = make(timeout_s=60.0)
    t = early(manager, "r", NUM_TOKENS)
    manager.poll(0)
    assert t.state is State.PARKED and t.target == ""
    assert not stuck.poll(0), "the stalled worker was asked"
    stuck.close()


def test_a_prefill_worker_judges_stalls_by_its_stalled_step_timeout(redis_url):
    config = WorkerConfig("prefill", EngineConfig(ModelConfig("dummy:tiny-llama"), device="cpu"),
                          model_name="tiny", redis_url=redis_url, insecure_zmq=True, stalled_step_timeout_s=7.0)
    worker = PrefillWorker(config)  # nothing started: no model loaded, nothing registered
    try:
        assert worker.handoff.stalled_step_timeout_s == 7.0
    finally:
        worker.handoff.close()
        worker.runtime.ctx.destroy(linger=0)
        worker.runtime.redis.close()
