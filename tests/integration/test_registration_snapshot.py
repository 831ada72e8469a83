"""The heartbeat against a real Redis while the engine loop holds the step lock: a beat does not wait for the
step, and what it publishes is the loop's snapshot from the end of a turn, never the state a step is halfway
through changing, with how long the step in progress has run. The host is the worker's step lock with one model whose engine counts the test sets; the
config is what a registration reads of it."""

import threading
import time
from types import SimpleNamespace

from kvrelay.gateway.control.stalled_workers import Stalls
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.worker.registration import Registration
from kvrelay.shared.worker.step_lock import StepLock

WORKER = "w-snapshot"


def _registration(redis_url: str) -> tuple[Registration, SimpleNamespace]:
    redis = sync_client(redis_url)
    redis.flushall()
    core = SimpleNamespace(num_free_blocks=64, num_total_blocks=64, num_running=0, num_waiting=0, max_model_len=256,
                           vocab_size=100, block_size=8, dtype="float32", scheduling_policy="fcfs")
    slot = SimpleNamespace(instance="m", name="m", version=0, path="/m", eos_ids=[2], core=core)
    host = SimpleNamespace(lock=StepLock(), slots={"m": slot}, pool=None, status=lambda: [], weights_budget=0,
                           weights_used=0, overhead_used=0)
    config = SimpleNamespace(worker_id=WORKER, role="unified", model_repo=None, register=[])
    return Registration(redis, config, host, draining=lambda: False), core


def _published(reg: Registration) -> WorkerInfo:
    return decode(reg.redis.get(keys.worker_key(WORKER)), WorkerInfo)


def test_a_beat_during_a_step_publishes_the_last_turn_s_counts_without_waiting_for_the_step(redis_url):
    reg, core = _registration(redis_url)
    reg.heartbeat()  # at start, as the runtime does: the first snapshot
    first = _published(reg).heartbeat
    in_step, release = threading.Event(), threading.Event()

    def step() -> None:
        with reg.host.lock.turn():
            core.num_running, core.num_free_blocks = 3, 40  # the step is changing what the worker advertises
            in_step.set()
            release.wait(120)
            reg.advert.turn_ended()

    loop = threading.Thread(target=step)
    loop.start()
    in_step.wait(60)
    beat = threading.Thread(target=reg._beat)
    beat.start()
    beat.join(60)
    beat_done = not beat.is_alive()  # while the step still holds the lock
    published = _published(reg) if beat_done else None
    release.set()
    loop.join(60)
    beat.join(60)
    assert beat_done, "the beat waited for the step"
    assert published.heartbeat > first
    assert (published.running, published.free_blocks) == (0, 64)  # the turn before, not the step's half-way state
    assert published.step_age_s > 0  # but how long the step has run is of now: gateways route by it
    reg._beat()
    assert (_published(reg).running, _published(reg).free_blocks) == (3, 40)  # the snapshot of the turn's end
    assert _published(reg).step_age_s == 0  # between turns


def test_a_loop_waiting_behind_a_load_is_not_stalled_and_a_stuck_step_is(redis_url):
    reg, _ = _registration(redis_url)
    reg.heartbeat()
    stalls = Stalls(timeout_s=60)  # the gateway's judgement, of what the beats publish
    lock = reg.host.lock
    load_holds, load_done, in_turn, turn_done = (threading.Event() for _ in range(4))

    def load() -> None:  # a model load building its engine under the lock, as on CUDA
        with lock:
            load_holds.set()
            load_done.wait(60)

    def loop() -> None:
        with lock.turn():
            in_turn.set()
            turn_done.wait(60)
            reg.advert.turn_ended()

    threads = [threading.Thread(target=load), threading.Thread(target=loop)]
    threads[0].start()
    load_holds.wait(60)
    threads[1].start()
    while lock.wait_since is None:
        time.sleep(0.001)
    lock.wait_since -= 600  # the loop has waited ten minutes for the load: no step of its own ran that long
    reg._beat()
    waiting = _published(reg)
    stalls.update([waiting])
    assert waiting.step_age_s == 0 and stalls.routable([waiting]) == [waiting]
    load_done.set()
    in_turn.wait(60)
    lock.turn_since -= 600  # its own step, stuck for ten minutes
    reg._beat()
    stuck = _published(reg)
    stalls.update([stuck])
    turn_done.set()
    for t in threads:
        t.join(60)
    assert stuck.step_age_s >= 600 and stalls.routable([stuck]) == []


def test_no_beat_brings_back_the_record_unregister_deleted(redis_url):
    reg, _ = _registration(redis_url)
    reg.heartbeat()
    reg.unregister()
    reg._beat()
    assert not reg.redis.exists(keys.worker_key(WORKER))
