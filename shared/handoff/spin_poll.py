"""``zmq.Poller.poll`` that spins on ``poll(0)`` for a while before it blocks: for a loop that waits on a reply due
within about a round trip (a grant after an ask, the header after a grant, the ack after the header). A thread
blocked in poll sleeps until the kernel wakes it for the message, and on some hosts that wake-up, not the message,
is most of a small message's latency (bench/zmq_rtt.py times both); a spin costs a core for at most ``spin_s``
and is only asked for while such a reply is due."""

import os
import time

import zmq

# how long a wait spins while a reply is due: a few control round trips, so the reply of a peer that answers at
# once is caught spinning, and one that is busy (a decode step between its polls) costs no more than this
REPLY_SPIN_S = 0.002


def poll(poller: zmq.Poller, timeout_ms: int, spin_s: float = 0.0) -> list:
    """``poller.poll(timeout_ms)``, whose first ``spin_s`` (never more than the timeout) are spent spinning."""
    if spin_s <= 0 or timeout_ms == 0:
        return poller.poll(timeout_ms)
    start = time.perf_counter()
    spin = spin_s if timeout_ms is None or timeout_ms < 0 else min(spin_s, timeout_ms / 1000)
    while True:
        if ready := poller.poll(0):
            return ready
        waited = time.perf_counter() - start
        if waited >= spin:
            break
        # the message is carried by this process's ZMQ I/O thread (and the peer's): on a host with few cores
        # a spin that never gives up its core would hold the very reply it waits for
        os.sched_yield()
    if timeout_ms is None or timeout_ms < 0:
        return poller.poll(timeout_ms)
    return poller.poll(max(0, round(timeout_ms - waited * 1000)))
