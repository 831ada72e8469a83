"""What one gateway process spends per admitted request and per streamed token:
``python -m kvrelay.bench.gateway_cpu``.

Starts ``kvrelay serve`` (unified, one gateway, the dummy tiny llama on the CPU unless told otherwise), then
drives it with ``kvrelay bench serve``'s client: an admission load (many 1-token requests: what the gateway does
before a job reaches Redis, which every request of a wave waits for in turn) and a streaming load (long outputs:
the per-token path from the worker's events to the SSE write). The gateway's CPU is read from the kernel
(its process's user + system time) around each load, so the client's own CPU, on the same host, is not in it.
Each load runs ``--rounds`` times in the same server; compare two trees by running this in each, alternating.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvrelay.bench.serve_client import RequestSpec, make_prompts, run_load
from kvrelay.shared.wire.loopback_ports import free_port


def _cpu_s(pid: int) -> float:
    """User + system seconds of one process, from /proc (no psutil needed on the GPU host)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ready(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=5) as resp:
                if resp.status == 200:
                    return int(json.load(resp)["gateway_pid"])
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"serve not ready after {timeout_s} s: {log.read_text()[-2000:]}")


def _load(base: str, model: str, n: int, input_len: int, output_len: int, concurrency: int, seed: int):
    spec = RequestSpec(url=f"{base}/v1/completions", endpoint="completions", model=model,
                       output_len=output_len, ignore_eos=True, cache_salt=f"salt-{seed}")
    prompts = make_prompts("random", n, input_len, seed, (10, 500))  # within the tiny models' vocabulary
    return asyncio.run(run_load(base, spec, prompts, [0.0] * n, concurrency, timeout_s=600))


def _spy(pid: int, out: Path) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "1000", "--format", "raw",
                            "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the load starts
    return spy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny-llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--admit-requests", type=int, default=512)
    ap.add_argument("--stream-requests", type=int, default=256)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="more flags for kvrelay serve")
    ap.add_argument("--profile", metavar="DIR", help="py-spy the gateway through each load of the first round "
                    "into DIR/<load>.txt (collapsed stacks: flamegraph.pl or speedscope read them)")
    args = ap.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="gateway_cpu_"))
    log = work / "serve.log"
    cmd = [sys.executable, "-m", "kvrelay.cli", "serve", "--mode", "unified", "--model", args.model,
           "--served-model-name", "m", "--load-format", "dummy", "--device", args.device, "--port", str(port),
           "--api-server-count", "1", "--max-num-seqs", str(args.concurrency), "--state-dir", str(work / "state"),
           *args.serve_args.split()]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pid = _ready(base, proc, log)
        _load(base, "m", 32, args.input_len, 4, args.concurrency, seed=0)  # warm: connections, first steps
        rows = {"admit": [], "stream": []}
        for r in range(args.rounds):
            for kind, n, out in (("admit", args.admit_requests, 1),
                                 ("stream", args.stream_requests, args.stream_tokens)):
                spy = _spy(pid, Path(args.profile) / f"{kind}.txt") if args.profile and r == 0 else None
                before = _cpu_s(pid)
                results, wall = _load(base, "m", n, args.input_len, out, args.concurrency, seed=1 + r)
                cpu = _cpu_s(pid) - before
                if spy is not None:
                    spy.send_signal(2)  # py-spy writes its file on SIGINT
                    spy.wait(60)
                bad = [x.error for x in results if not x.success]
                if bad:
                    sys.exit(f"{len(bad)} of {n} requests failed, first: {bad[0]}")
                tokens = sum(x.output_tokens for x in results)
                ttft = statistics.mean(x.ttft for x in results) * 1e3
                unit = n if kind == "admit" else tokens
                rows[kind].append((wall, cpu / unit * 1e6, ttft, tokens / wall))
                print(f"round {r} {kind:6s}: wall {wall:6.2f} s, gateway CPU {cpu / unit * 1e6:7.1f} us per "
                      f"{'request' if kind == 'admit' else 'token'}, TTFT mean {ttft:6.1f} ms, "
                      f"{tokens / wall:8.0f} out tok/s", flush=True)
        for kind, got in rows.items():
            per = [g[1] for g in got]
            print(f"{kind}: gateway CPU per {'request' if kind == 'admit' else 'token'} median "
                  f"{statistics.median(per):.1f} us (of {len(per)}: {', '.join(f'{p:.1f}' for p in per)})")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


if __name__ == "__main__":
    main()
