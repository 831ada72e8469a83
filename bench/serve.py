"""``kvrelay bench serve``: a load generator for any OpenAI-compatible server, reporting in vLLM
benchmark_serving's layout; optionally it launches ``kvrelay serve`` itself (one or both modes, one after
the other) and replays the same workload through the offline engine for a same-run baseline.

    kvrelay bench serve --base-url http://127.0.0.1:8000/v1 --num-prompts 32 --max-concurrency 8
    kvrelay bench serve --launch disaggregated unified --compare-offline -- --model smollm2
    kvrelay bench serve --launch unified --cold-start --request-rate 8 --num-prompts 200 -- --model smollm2
    kvrelay bench serve --launch disaggregated unified --sweep --compare-offline -- --model smollm2

Each run also prints the TTFT of its first --cold-requests requests beside the rest's; with --cold-start
they are the first requests after /ready, which shows what a fresh server left unprepared (compiles). Under
each run's table, the server's own split of its requests' TTFT into stages (bench/ttft_stages.py).
With --sweep it searches each server's goodput instead (bench/serve_sweep.py).
"""

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse

from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.wire.loopback_ports import free_port

READY_TIMEOUT_S = 600.0  # a first run imports SmolLM2's GGUF before the workers start
STOP_GRACE_S = 30.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1 "
                   "(default: that, unless --launch starts a server)")
    p.add_argument("--model", default=None, help="model name in requests (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["random", "text"], default="random",
                   help="random: token-id prompts of --input-len (completions only); text: built-in prompts")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default: 64; 1024 with --sweep)")
    p.add_argument("--output-len", type=int, default=None, help="tokens generated (default: 32; 128 with --sweep)")
    p.add_argument("--random-token-range", type=int, nargs=2, default=[100, 500], metavar=("LO", "HI"),
                   help="random prompt ids come from [LO, HI); the default fits every model's vocabulary")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens per request")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, req/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before it counts as failed")
    p.add_argument("--token-timing", choices=["logprobs", "text"], default="logprobs",
                   help="logprobs: request the sampled token's logprob so every token is timed when it arrives; "
                        "text: time only chunks with text, as a plain client sees them")
    p.add_argument("--cold-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="send a fresh cache_salt per run, so a rerun against the same server misses its prefix cache")
    p.add_argument("--launch", nargs="+", choices=["disaggregated", "unified"], default=None,
                   help="start `kvrelay serve --mode M` with the engine args after --, run, stop; modes run in turn")
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the prompts through kvrelay.LLM with the engine args after -- and print ratios")
    p.add_argument("--offline-only", action="store_true",
                   help="load no server: run only the offline engine (the engine args after --) on the prompts and "
                        "schedule a served run with these flags would send, for scripts that load servers of their own")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --base-url that is not a loopback address (the default refuses, so a typo "
                        "cannot aim a load test at someone else's server)")
    p.add_argument("--cold-start", action="store_true",
                   help="start the load the moment /ready is true, without the warm-up request before it, so the "
                        "first requests meet the server as a fresh start leaves it (with --base-url: waits for /ready)")
    p.add_argument("--cold-requests", type=int, default=100, metavar="N",
                   help="TTFT of the first N requests is printed beside the rest's (the steady state), with the ratio")
    p.add_argument("--save-result", "--json", default=None, metavar="FILE",
                   help="write every metric and per-request data as JSON (with --sweep: every trial's metrics)")
    g = p.add_argument_group("goodput sweep", "the highest Poisson rate at which both p99 SLOs hold, per server")
    g.add_argument("--sweep", action="store_true",
                   help="instead of one run: double the rate from --sweep-start until a trial misses an SLO, then "
                        "bisect to --sweep-resolution; every trial on the same running server (each --launch mode "
                        "in turn); with --compare-offline each found rate as a fraction of the offline engine's req/s")
    g.add_argument("--slo-ttft-ms", type=float, default=300.0, help="p99 time to first token a trial must hold (default: %(default)s)")
    g.add_argument("--slo-itl-ms", type=float, default=25.0, help="p99 inter-token latency a trial must hold (default: %(default)s)")
    g.add_argument("--sweep-start", type=float, default=4.0, metavar="REQ_S", help="the first rate tried (default: %(default)s)")
    g.add_argument("--sweep-resolution", type=float, default=1.0, metavar="REQ_S",
                   help="stop once the lowest failing rate is this close above the best passing one "
                        "(default: %(default)s)")
    g.add_argument("--sweep-max-trials", type=int, default=12, help="at most this many trials per server (default: %(default)s)")
    g.add_argument("--sweep-min-rate", type=float, default=0.0, metavar="REQ_S",
                   help="when the start rate fails, halve it no lower than this (0: down to --sweep-resolution); "
                        "a trial lasts --sweep-requests / rate seconds, so low rates are slow to try")
    g.add_argument("--sweep-rates", type=float, nargs="+", default=None, metavar="REQ_S",
                   help="try exactly these rates, in order, instead of searching (each trial still judged "
                        "against the SLOs and split into TTFT stages)")
    g.add_argument("--sweep-requests", type=int, default=200,
                   help="requests per trial (the same prompts each time; enough for a meaningful p99; default: %(default)s)")
    p.add_argument("engine_args", nargs="*", help="after --: engine flags for --launch and --compare-offline")


def _check_args(args: argparse.Namespace) -> None:
    # the sweep's default load is the one its SLOs are quoted for (issue #23): 1,024 prompt -> 128 output tokens
    if args.input_len is None:
        args.input_len = 1024 if args.sweep else 64
    if args.output_len is None:
        args.output_len = 128 if args.sweep else 32
    if args.sweep:
        _check_sweep_args(args)
    elif args.sweep_rates:
        raise SystemExit("--sweep-rates names the rates of a --sweep")
    if args.dataset == "random" and args.endpoint == "chat":
        raise SystemExit("--dataset random sends token ids, which only --endpoint completions accepts")
    if args.num_prompts < 1 or args.output_len < 1 or (args.dataset == "random" and args.input_len < 1):
        raise SystemExit("--num-prompts, --input-len and --output-len must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be positive")
    if args.cold_requests < 1:
        raise SystemExit("--cold-requests must be at least 1")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be positive (inf: all at once)")
    if args.launch and args.base_url:
        raise SystemExit("--launch starts its own server; drop --base-url")
    if args.offline_only and (args.launch or args.base_url or args.sweep or args.compare_offline):
        raise SystemExit("--offline-only loads no server: drop --launch, --base-url, --sweep and --compare-offline")
    if args.offline_only and not args.engine_args:
        raise SystemExit("--offline-only runs the engine args after --: give them (e.g. -- --model smollm2)")


def _check_sweep_args(args: argparse.Namespace) -> None:
    from kvrelay.rate_search import SearchSpace, Slo

    if args.request_rate != float("inf"):
        raise SystemExit("--sweep chooses the rates; give the first with --sweep-start, not --request-rate")
    if args.cold_start:
        raise SystemExit("--sweep warms each server once before its first trial; drop --cold-start")
    if args.sweep_requests < 1:
        raise SystemExit("--sweep-requests must be at least 1")
    if args.sweep_rates and min(args.sweep_rates) <= 0:
        raise SystemExit("--sweep-rates must be positive")
    try:
        SearchSpace(args.sweep_start, args.sweep_resolution, args.sweep_max_trials, args.sweep_min_rate).check()
        Slo(args.slo_ttft_ms, args.slo_itl_ms).check()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise SystemExit(f"cannot resolve {host!r}: {exc}") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"{base_url} is not a loopback address ({', '.join(sorted(addrs))}); "
                         "pass --allow-remote to load-test it anyway")




def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=2) as resp:
            if not json.load(resp)["data"]:
                return False
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/ready", timeout=2) as resp:
            return resp.status == 200
    except (OSError, ValueError, KeyError):
        return False


def _wait_ready(base_url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _ready(base_url):
        if time.monotonic() > deadline:
            raise SystemExit(f"{base_url} did not become ready in {READY_TIMEOUT_S:.0f}s")
        time.sleep(0.1)


@contextlib.contextmanager
def launched(mode: str, engine_args: list[str], log_dir: Path) -> Iterator[str]:
    """``kvrelay serve --mode MODE`` on a free loopback port until the block ends; yields its base URL."""
    port = free_port()
    log_path = log_dir / f"serve-{mode}.log"
    # host and port last: they must win over anything in the pass-through args; a fresh state folder (the
    # embedded Redis's data) per launch, so one run's tenants and counters never reach the next
    state_dir = tempfile.mkdtemp(prefix=f"state-{mode}-", dir=log_dir)
    argv = [*module_argv("kvrelay.cli"), "serve", "--mode", mode, *engine_args,
            "--host", "127.0.0.1", "--port", str(port), "--state-dir", state_dir]
    base_url = f"http://127.0.0.1:{port}/v1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(base_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"kvrelay serve --mode {mode} did not become ready (log {log_path}):\n{tail}")
            time.sleep(0.1)  # --cold-start measures from the moment of ready: notice it promptly
        print(f"launched kvrelay serve --mode {mode} at {base_url} (log {log_path})", flush=True)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # serve stops its workers and Redis on SIGINT
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _load() -> float:
    return os.getloadavg()[0]


async def _request_spec(args: argparse.Namespace, base_url: str, warmup):
    """The request shape for this server (its model found through /v1/models), after one warm-up request
    unless --cold-start asks for none."""
    from kvrelay.bench.serve_client import RequestSpec, first_model, run_load

    if args.cold_start:
        _wait_ready(base_url)
    model = args.model or await first_model(base_url)
    url = f"{base_url}/chat/completions" if args.endpoint == "chat" else f"{base_url}/completions"
    salt = uuid.uuid4().hex if args.cold_cache else None
    spec = RequestSpec(url=url, endpoint=args.endpoint, model=model, output_len=args.output_len,
                       ignore_eos=args.ignore_eos, cache_salt=salt, token_logprobs=args.token_timing == "logprobs")
    if not args.cold_start:
        warm, _ = await run_load(base_url, spec, [warmup], [0.0], 1, args.request_timeout)
        if not warm[0].success:  # a server that cannot answer one request would only produce N failures
            raise SystemExit(f"warm-up request to {url} failed: {warm[0].error}")
    return spec


async def _bench_server(args: argparse.Namespace, base_url: str, label: str, prompts: list, warmup,
                        offsets: list[float]) -> dict:
    from kvrelay.bench.serve_client import run_load
    from kvrelay.bench.serve_metrics import cold_vs_steady, summarize
    from kvrelay.bench.ttft_stages import scrape
    from kvrelay.ttft_readout import breakdown, diff

    spec = await _request_spec(args, base_url, warmup)
    load_before = _load()
    before = await scrape(base_url)  # after the warm-up: the stages are the run's requests' alone
    cpu0 = time.process_time()
    results, duration = await run_load(base_url, spec, prompts, offsets, args.max_concurrency, args.request_timeout)
    # the client's own CPU over the run: near one core, the client (one event loop) and not the server may be
    # what sets the throughput and the TTFT measured
    client_cpu = (time.process_time() - cpu0) / duration
    m = summarize(label, results, duration)
    m["client_cpu_share"] = client_cpu
    m["ttft_stages"] = breakdown(diff(before, await scrape(base_url)))
    m["cold_start"] = {**cold_vs_steady(results, args.cold_requests), "from_ready": args.cold_start}
    m.update(base_url=base_url, model_id=spec.model, load_avg_1m_before=load_before, load_avg_1m_after=_load())
    return m


def run(args: argparse.Namespace) -> int:
    from kvrelay.bench.serve_client import arrival_offsets, make_prompts
    from kvrelay.bench.serve_metrics import compare, print_comparison, print_result
    from kvrelay.bench.ttft_stages import print_breakdown

    _check_args(args)
    if args.sweep:
        args.num_prompts = args.sweep_requests  # every trial sends these same prompts
    prompts = make_prompts(args.dataset, args.num_prompts, args.input_len, args.seed, tuple(args.random_token_range))
    # its own seed: a warm-up identical to a benchmark prompt would hand that prompt a prefix-cache hit
    warmup = make_prompts(args.dataset, 1, args.input_len, args.seed + 1_000_003, tuple(args.random_token_range))[0]
    if args.sweep:
        return _run_sweep(args, prompts, warmup)
    offsets = arrival_offsets(args.num_prompts, args.request_rate, args.seed)
    if args.offline_only:
        return _run_offline_only(args, prompts, warmup, offsets)
    print(f"{args.num_prompts} prompts ({args.dataset}, {args.input_len if args.dataset == 'random' else 'text'} in / "
          f"{args.output_len} out), request rate {args.request_rate}, max concurrency {args.max_concurrency}, "
          f"endpoint {args.endpoint}; load average {os.getloadavg()}", flush=True)

    served: list[dict] = []
    with contextlib.closing(_targets(args)) as targets:
        for label, base_url in targets:
            served.append(asyncio.run(_bench_server(args, base_url, label, prompts, warmup, offsets)))
            print_result(served[-1], f"Serving Benchmark Result ({label})" if args.launch else "Serving Benchmark Result")
            print_breakdown(served[-1]["ttft_stages"], indent=0)

    offline: dict[str, dict] = {}
    rows: list[dict] = []
    if args.compare_offline:
        from kvrelay.bench.serve_metrics import summarize
        from kvrelay.bench.serve_offline import run_offline

        # after the servers are gone, so the engine has the machine to itself as each server had
        passes = run_offline(args.engine_args, prompts, warmup, args.endpoint, args.output_len, args.ignore_eos,
                             offsets, args.max_concurrency, logprobs=args.token_timing == "logprobs")
        for name, (results, duration) in passes.items():
            offline[name] = summarize(name, results, duration)
            print_result(offline[name], f"Offline engine ({name.removeprefix('offline, ')})")
        rows = compare(served, offline)
        print_comparison(served, offline, rows)

    _save(args, {"runs": served, "offline": offline, "comparison": rows})
    return 0 if all(m["failed"] == 0 for m in served) else 1


def _run_offline_only(args: argparse.Namespace, prompts: list, warmup, offsets: list[float]) -> int:
    from kvrelay.bench.serve_metrics import print_result, summarize
    from kvrelay.bench.serve_offline import run_offline

    passes = run_offline(args.engine_args, prompts, warmup, args.endpoint, args.output_len, args.ignore_eos,
                         offsets, args.max_concurrency, logprobs=args.token_timing == "logprobs")
    offline = {name: summarize(name, results, duration) for name, (results, duration) in passes.items()}
    for name, m in offline.items():
        print_result(m, f"Offline engine ({name.removeprefix('offline, ')})")
    _save(args, {"runs": [], "offline": offline, "comparison": []})
    return 0 if all(m["failed"] == 0 for m in offline.values()) else 1


def _targets(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(label, base URL) of each server to load: each --launch mode in turn, started before its turn and
    stopped after it, or the one at --base-url. Callers close it (contextlib.closing), so an error in a
    turn stops that turn's server at once rather than whenever the generator is collected."""
    if args.launch:
        log_dir = Path(tempfile.mkdtemp(prefix="kvrelay-bench-serve-"))
        for mode in args.launch:
            with launched(mode, args.engine_args, log_dir) as base_url:
                yield mode, base_url
    else:
        base_url = (args.base_url or "http://127.0.0.1:8000/v1").rstrip("/")
        if not args.allow_remote:
            _check_loopback(base_url)
        yield "served", base_url


async def _sweep_one(args: argparse.Namespace, base_url: str, label: str, prompts: list, warmup) -> dict:
    from kvrelay.bench.serve_sweep import sweep_server
    from kvrelay.rate_search import SearchSpace, Slo

    spec = await _request_spec(args, base_url, warmup)  # the server's one warm-up, before its first trial
    return await sweep_server(base_url, spec, prompts, label, Slo(args.slo_ttft_ms, args.slo_itl_ms),
                              SearchSpace(args.sweep_start, args.sweep_resolution, args.sweep_max_trials,
                                          args.sweep_min_rate),
                              args.seed, args.max_concurrency, args.request_timeout, args.sweep_rates)


def _run_sweep(args: argparse.Namespace, prompts: list, warmup) -> int:
    from kvrelay.bench.serve_sweep import KEPT, print_summary

    print(f"goodput sweep: {len(prompts)} prompts per trial ({args.dataset}, {args.input_len} in / {args.output_len} "
          f"out), endpoint {args.endpoint}; load average {os.getloadavg()}", flush=True)
    with contextlib.closing(_targets(args)) as targets:
        modes = [asyncio.run(_sweep_one(args, base_url, label, prompts, warmup)) for label, base_url in targets]
    offline = None
    if args.compare_offline:
        from kvrelay.bench.serve_metrics import summarize
        from kvrelay.bench.serve_offline import run_offline

        # the engine's capacity: every prompt at once, after the servers are gone (the machine to itself)
        passes = run_offline(args.engine_args, prompts, warmup, args.endpoint, args.output_len, args.ignore_eos,
                             [0.0] * len(prompts), None, logprobs=args.token_timing == "logprobs")
        m = summarize("offline, all at once", *passes["offline, all at once"])
        offline = {"label": m["label"], **{k: m[k] for k in KEPT}}
    print_summary(modes, offline["request_throughput"] if offline else None)
    search = {"start": args.sweep_start, "resolution": args.sweep_resolution, "max_trials": args.sweep_max_trials,
              "min_rate": args.sweep_min_rate,
              "requests_per_trial": len(prompts), "input_len": args.input_len, "output_len": args.output_len}
    _save(args, {"sweep": {"slo": {"p99_ttft_ms": args.slo_ttft_ms, "p99_itl_ms": args.slo_itl_ms},
                           "search": search, "modes": modes, "offline": offline}})
    # a trial in which nothing completed means a broken server, not a rate beyond its goodput
    return 0 if all(t["completed"] for m in modes for t in m["trials"]) else 1


def _save(args: argparse.Namespace, results: dict) -> None:
    if args.save_result:
        doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "argv": sys.argv,
               # inf is not JSON: strict parsers (jq, JavaScript) would reject the whole file
               "config": {k: str(v) if v == float("inf") else v for k, v in vars(args).items() if k != "func"},
               "cpu_count": os.cpu_count(), **results}
        Path(args.save_result).write_text(json.dumps(doc, indent=1, default=str))
        print(f"results written to {args.save_result}")
