"""Round trips of one small ZMQ message between two processes, by how each side waits: ``python -m
kvrelay.bench.zmq_rtt``.

A handoff is four one-way control messages (ask, grant, header, ack), each received by a process that was
waiting for it. Blocked in ``poll``, a process's thread sleeps, and waking it costs whatever the host's scheduler
and idle states cost; spinning on ``poll(0)`` costs a core instead. This times both, and spinning a while before
blocking, over tcp on loopback as the workers talk: median and p99 microseconds a round trip.
"""

import argparse
import multiprocessing as mp
import statistics
import time

import zmq

WAITS = ("block", "spin", "spin 200 us, then block")


def wait_for(sock: zmq.Socket, poller: zmq.Poller, how: str) -> None:
    if how == "spin":
        while not poller.poll(0):
            pass
        return
    if how.startswith("spin "):
        until = time.perf_counter() + 200e-6
        while time.perf_counter() < until:
            if poller.poll(0):
                return
    poller.poll(1000)


def echo(addr: str, how: str, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.connect(addr)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    for _ in range(count):
        wait_for(sock, poller, how)
        sock.send_multipart(sock.recv_multipart())
    sock.close(linger=0)
    ctx.term()


def rtts(how: str, count: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = mp.get_context("spawn").Process(target=echo, args=(f"tcp://127.0.0.1:{port}", how, count + 1))
    peer.start()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    sock.send(b"x" * 200)  # the connection up, both sides warm
    poller.poll(10_000)
    sock.recv()
    out = []
    for _ in range(count):
        time.sleep(0.001)  # as between a handoff's messages: the peer went back to waiting
        t0 = time.perf_counter()
        sock.send(b"x" * 200)
        wait_for(sock, poller, how)
        sock.recv()
        out.append(time.perf_counter() - t0)
    peer.join(10)
    sock.close(linger=0)
    ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=500)
    args = ap.parse_args()
    print(f"round trip of a 200-byte message, DEALER -> ROUTER over tcp loopback, {args.count} each, microseconds")
    print("| both sides wait by | median | p99 | vs block (median) |")
    print("| --- | --- | --- | --- |")
    base = None
    for how in WAITS:
        times = sorted(rtts(how, args.count))
        med, p99 = statistics.median(times) * 1e6, times[int(0.99 * (len(times) - 1))] * 1e6
        base = base or med
        print(f"| {how} | {med:.1f} | {p99:.1f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
