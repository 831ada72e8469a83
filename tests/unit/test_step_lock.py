"""The engine loop's step lock: a waiting heartbeat or loader gets in after at most the step in progress; the
age of the loop's turn, which heartbeats publish, counts the turn alone, not the loop's wait for it."""

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


def test_the_turn_age_counts_the_loop_s_turn_alone_not_its_wait_for_one_another_thread_holds():
    lock = StepLock()
    assert lock.turn_age() == 0.0  # between turns
    load_holds, load_done = threading.Event(), threading.Event()
    in_turn, turn_done = threading.Event(), threading.Event()

    def load() -> None:  # a model load building its engine (capturing CUDA graphs) under the lock
        with lock:
            load_holds.set()
            load_done.wait(60)

    def loop() -> None:
        with lock.turn():
            in_turn.set()
            turn_done.wait(60)

    threads = [threading.Thread(target=load), threading.Thread(target=loop)]
    threads[0].start()
    load_holds.wait(60)
    threads[1].start()
    while lock.wait_since is None:  # the loop waits for its turn
        time.sleep(0.001)
    lock.wait_since -= 600  # for ten minutes now: the load's work, not a step of the loop's
    assert lock.turn_age() == 0.0
    load_done.set()
    in_turn.wait(60)
    lock.turn_since -= 75  # a step that has run 75 s
    assert lock.turn_age() >= 75
    turn_done.set()
    for t in threads:
        t.join(60)
    assert lock.turn_age() == 0.0
