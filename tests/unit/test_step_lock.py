"""The engine loop's step lock: a waiting heartbeat or loader gets in after at most the step in progress; the
age of the loop's turn, which heartbeats publish, counts from its wait for the turn to the turn's end."""

import threading
import time

from kvrelay.shared.worker.step_lock import StepLock


def test_a_waiting_thread_gets_the_lock_after_at_most_one_step():
    lock = StepLock()
    steps = 0
    stop = threading.Event()
    started = threading.Event()

    def loop():
        nonlocal steps
        while not stop.is_set():
            with lock.turn():  # released and taken again at once, as the worker loop does
                started.set()
                time.sleep(0.002)
                steps += 1

    t = threading.Thread(target=loop)
    t.start()
    started.wait(5)
    waited = []
    for _ in range(50):
        before = steps
        with lock:
            waited.append(steps - before)
    stop.set()
    t.join(60)
    assert max(waited) <= 1, waited


def test_reentrant_in_the_loop_and_in_other_threads():
    lock = StepLock()
    with lock.turn():
        with lock:  # the step itself takes it again (a model's pool attach)
            with lock.turn():
                pass
    box = []

    def other():
        with lock:
            with lock:
                box.append(1)

    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    assert box == [1]
    with lock.turn():  # fully released by both
        pass


def test_the_turn_age_counts_from_the_wait_for_a_turn_to_its_end():
    lock = StepLock()
    assert lock.turn_age() == 0.0  # between turns
    lock.wait_since = time.monotonic() - 10  # the loop waits for its turn while a model load holds the lock
    assert lock.turn_age() >= 10
    lock.wait_since = None
    with lock.turn():
        lock.turn_since -= 75  # a step that has run 75 s
        with lock.turn():  # re-entered inside the step: still that turn
            assert lock.turn_age() >= 75
    assert lock.turn_age() == 0.0
