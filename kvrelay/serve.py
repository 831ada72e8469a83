"""``kvrelay serve``: everything on one machine. An embedded Redis (unless --redis-url), then the
gateway and the workers as separate processes on loopback, all supervised (kvrelay/supervisor.py): a child
that dies is started again with backoff (Redis at once, from its append-only file in --state-dir,
kvrelay/state_dir.py, at the same address with the same passwords), and one that keeps dying stops
everything with the reason and exit code 1. Start-up fails in one line and exit code 2, within seconds: a
state folder another serve holds, a fixed port in use or an external Redis that does not answer is found
before anything starts (kvrelay/startup_checks.py), and a child that
exits before it was ever ready (a setting its model refuses, too little memory) stops everything with the
cause it reported, never restarted. "kvrelay ready" is printed once our own gateways said they listen and
each of them answered /ready with 200. Every child runs in a session of its own, so a terminal's Ctrl-C
reaches this process alone: Ctrl-C or SIGTERM drains the gateways and workers, and only once they are gone
(unregistered) does the embedded Redis stop; a second Ctrl-C ends the workers' drain at once. Nothing is left
behind (children also get SIGTERM from the kernel if this process is killed outright)."""

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import redis

from kvrelay import weight_scope
from kvrelay.metrics_dir import MetricsDir
from kvrelay.mps_daemon import MpsDaemon
from kvrelay.serve_plan import Child, models_to_serve, plan, timesliced
from kvrelay.shared.config.auto_device import auto_device
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.gateway import ADMIN_KEY_ENV
from kvrelay.shared.config.handover import CONFIG_FROM_STDIN, encode, module_argv
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redacted_url import redact
from kvrelay.shared.wire.redis_acl import ROLE_OF_COMMAND
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client
from kvrelay.shared.wire.startup_report import FATAL, READY
from kvrelay.shared.worker.directory import live_workers
from kvrelay.shared.worker.gpu_share import MPS_MODES
from kvrelay.startup_checks import StartupError, check_ports, check_quantization, check_redis
from kvrelay.state_dir import FLAG as STATE_DIR_FLAG
from kvrelay.state_dir import StateDir, default_state_dir
from kvrelay.supervisor import Supervisor

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
READY_POLL_S = 0.1  # the ready line comes within this of the gateway's /ready turning 200
SUPERVISE_POLL_S = 0.2  # a dead child (Redis above all: every request needs it) is noticed within this
STORE = "redis"  # the embedded Redis, among the supervised children
STORE_BACKOFF_S = 0.05  # its first restart: back from its file in milliseconds, and everything waits on it
STORE_STARTUP_TIMEOUT_S = 60.0  # reading a large append-only file back takes a while; LOADING until then
# Until the embedded Redis runs (--print-config starts none), its URL is unknown
EMBEDDED_REDIS_PLACEHOLDER = "redis://embedded-redis-started-at-launch"


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a kill -9 of serve still stops the children


def _start(child: Child, args: argparse.Namespace, threads: int | None, print_config: bool,
           status_fd: int | None = None) -> subprocess.Popen:
    """The child reads its whole config from stdin; with --print-config it prints what it resolved.
    ``status_fd``: where it says it is ready, or why it could not start (kvrelay/supervisor.py)."""
    argv = [*module_argv("kvrelay.cli"), "--log-level", args.log_level, child.command, CONFIG_FROM_STDIN]
    env = _env(child, threads) | (Supervisor.status_env(status_fd) if status_fd is not None else {})
    proc = subprocess.Popen(argv + (["--print-config"] if print_config else []), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE if print_config else None, preexec_fn=_die_with_parent,
                            start_new_session=True, env=env, pass_fds=() if status_fd is None else (status_fd,))
    try:
        proc.stdin.write(encode(child.config, exclude=child.generated))
        proc.stdin.close()
    except BrokenPipeError:  # it died before reading its config (killed at birth): the supervisor sees it exit
        with contextlib.suppress(OSError):
            proc.stdin.close()
    return proc


def print_config(args: argparse.Namespace) -> int:
    """Each child, started as serve would start it, prints the config it resolved; nothing is served."""
    children = plan(args, models_to_serve(args), args.redis_url or EMBEDDED_REDIS_PLACEHOLDER)
    procs = [(child, _start(child, args, None, print_config=True)) for child in children]
    resolved = {}
    for child, proc in procs:
        out = proc.stdout.read()
        proc.wait()
        if proc.returncode:
            return proc.returncode
        resolved[child.name] = {"command": child.command, "config": json.loads(out)}
    print(json.dumps(resolved, indent=1, sort_keys=True))
    return 0


def serve(args: argparse.Namespace) -> int:
    if args.print_config:
        return print_config(args)
    stopping = False
    procs: dict[str, subprocess.Popen] = {}

    def on_signal(signum, _frame):
        nonlocal stopping
        if stopping:  # asked twice: a worker's second SIGTERM ends its drain at once
            _signal_all(procs)
        stopping = True

    # every config mistake surfaces here, before Redis or any process starts
    models = models_to_serve(args)
    children = plan(args, models, args.redis_url or EMBEDDED_REDIS_PLACEHOLDER)
    with contextlib.ExitStack() as stack:
        # so are a state folder another serve uses (its lock is held until the very end), a port in use
        # and an external Redis that does not answer: one line each, nothing started
        state_dir = None if args.redis_url else StateDir(args.state_dir or default_state_dir())
        state = stack.enter_context(state_dir) if state_dir else None
        check_quantization(models, args.quantization, args.config)
        check_ports(children)
        weight_scope.scope([c.config for c in children if not c.is_gateway], stack)
        if args.redis_url:
            check_redis(args.redis_url)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        starts = {}
        embedded = None
        if state_dir is not None:  # left last but the lock: Redis stops after every process that talks to it
            # it holds the folder's lock too: should serve be killed, the folder stays taken until Redis is gone
            embedded = EmbeddedRedis(state_dir=state, startup_timeout=STORE_STARTUP_TIMEOUT_S,
                                     preexec_fn=_die_with_parent, pass_fds=(state_dir.lock_fd,))
            stack.callback(embedded.stop)
            try:
                redis_url = embedded.prepare()
            except ValueError as exc:
                raise StartupError(f"{STATE_DIR_FLAG} {state}: {exc}") from None
            starts[STORE] = lambda fd: _start_store(embedded, fd)  # first: the others need it up
        else:
            redis_url = args.redis_url
        if any(getattr(c.config, "gpu_share", None) in MPS_MODES for c in children):
            _start_mps(args, children, stack)
        gateway_metrics = _share_gateway_metrics(children, stack)
        for child in children:  # on the embedded Redis, each child gets its role's least-privilege user
            url = embedded.role_url(ROLE_OF_COMMAND[child.command]) if embedded else redis_url
            child.config = dataclasses.replace(child.config, redis_url=url)
        threads = _cpu_threads_per_worker(args, sum(not c.is_gateway for c in children))
        starts |= {c.name: lambda fd, c=c: _start(c, args, threads, False, fd) for c in children}

        def on_exit(name: str, proc: subprocess.Popen) -> None:
            if name != STORE:
                _unregister_worker(redis_url, proc.pid)
            if gateway_metrics is not None and name in gateway_metrics.names:
                gateway_metrics.gone(proc.pid)

        supervisor = Supervisor(starts, args.max_crashes, args.crash_window, on_exit=on_exit,
                                backoff_start={STORE: STORE_BACKOFF_S})
        procs = supervisor.procs
        supervisor.start_all()
        names = [m.name for m in models]
        gateways = [c.name for c in children if c.is_gateway]
        log.info("serving %s on http://%s:%d (redis %s, %s mode, %d gateway process(es))", names, args.host,
                 args.port, redact(redis_url), args.mode, len(gateways))
        try:
            return _supervise(supervisor, lambda: stopping, f"http://{args.host}:{args.port}", names, gateways)
        finally:  # a StartupError is said by the CLI once everything stopped; Redis after the rest
            _stop_all(procs, args.drain_timeout + STOP_GRACE_S)


def _start_mps(args: argparse.Namespace, children: list[Child], stack: contextlib.ExitStack) -> None:
    """The MPS daemon the workers become clients of. One asked for by name that cannot start is one line, before
    any worker starts; one that --gpu-share auto chose leaves the workers timesliced, said in the log."""
    try:
        daemon = MpsDaemon().start()
    except ConfigError as exc:
        if args.gpu_share != "auto":
            raise
        log.warning("--gpu-share auto: timeslice, as the MPS daemon did not start (%s)", exc)
        timesliced(children)
        return
    stack.callback(daemon.stop)  # after every worker stopped (the stack unwinds after _stop_all)
    for child in children:
        if not child.is_gateway:
            child.env |= daemon.env
    shares = ", ".join(f"{c.command} {c.config.gpu_share} on {c.config.gpu_sm_percent}% of the SMs"
                       for c in children if not c.is_gateway)
    log.info("GPU share: %s (--gpu-share %s)", shares, args.gpu_share)


def _share_gateway_metrics(children: list[Child], stack: contextlib.ExitStack) -> MetricsDir | None:
    """Gateways sharing the port write their metrics into one folder, so /metrics sums them whichever answers."""
    gateways = [c for c in children if c.is_gateway]
    if len(gateways) < 2:
        return None
    folder = MetricsDir({c.name for c in gateways})
    stack.callback(folder.remove)  # after every gateway stopped (the stack unwinds after _stop_all)
    for child in gateways:
        child.env |= folder.env
    return folder


def _start_store(embedded: EmbeddedRedis, status_fd: int) -> subprocess.Popen:
    """The embedded Redis as a supervised child. redis-server writes no status line of its own, so serve
    writes it for it: ready once it answers PING (its append-only file read back), else why it failed."""
    proc = embedded.spawn()
    if embedded.wait_ready():
        os.write(status_fd, f"{READY}\n".encode())
    elif cause := _last_line(embedded.failure()):  # a damaged append-only file, most likely: say where it is
        os.write(status_fd, f"{FATAL}{cause} (its files: {embedded.state_dir})\n".encode())
    return proc


def _last_line(text: str) -> str:
    """redis-server's last word (its fatal error), without the pid, role and time that start its log lines."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return re.sub(r"^\d+:[A-Z] .*?\d\d:\d\d:\d\d\.\d+ [.*#-] ", "", lines[-1]) if lines else ""


def _cpu_threads_per_worker(args: argparse.Namespace, num_workers: int) -> int | None:
    """CPU workers split the cores: each one's math library otherwise starts a thread per core, and
    several processes spinning on the same cores slow a step down by an order of magnitude."""
    if num_workers <= 1 or "OMP_NUM_THREADS" in os.environ or args.device not in ("cpu", "auto"):
        return None  # decided before importing torch: ~3 s of CPU for a supervisor that needs nothing else of it
    if args.device == "auto" and auto_device() == "cuda":
        return None
    return max(1, (os.cpu_count() or 1) // num_workers)


def _env(child: Child, threads: int | None) -> dict[str, str]:
    """The admin key reaches the gateway inside its config, and no other process: workers have no use for it."""
    env = {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV} | child.env
    if threads is not None and not child.is_gateway:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _supervise(supervisor: Supervisor, stopping, base_url: str, models: list[str], gateways: list[str]) -> int:
    """Until Ctrl-C/SIGTERM: 0; a crash loop: 1; a child that never got ready raises StartupError. The
    ready line needs our own gateways listening (they said so over their status pipes): another server's
    /ready on the same port must not pass for ours."""
    announced = False
    answered: set[int] = set()  # the gateway processes whose /ready said 200
    while not stopping():
        if reason := supervisor.check():
            log.error("%s", reason)
            return 1
        if not announced and all(supervisor.ready(g) for g in gateways) and (pid := _ready(base_url)) is not None:
            answered.add(pid)
            # each gateway loads its own tokenizers, and says 200 only once they are in: one that has not would
            # make its first requests wait for the load. Each poll is a new connection, which the kernel hands to
            # any of the gateways sharing the port, so every one of them is asked within a few polls
            if {supervisor.procs[g].pid for g in gateways} <= answered:
                announced = True
                print(f"kvrelay ready: {base_url}/v1 serving {', '.join(models)}", flush=True)
        time.sleep(READY_POLL_S if not announced else SUPERVISE_POLL_S)
    return 0


def _unregister_worker(redis_url: str, pid: int) -> None:
    """A worker killed outright cannot unregister itself; until its heartbeat's TTL lapsed, gateways would
    queue its models' requests and wait on the requests it held, and prefill workers would hand it KV.
    Removing its registration at once turns that into a prompt 503 + Retry-After."""
    client = sync_client(redis_url)
    try:
        for w in live_workers(client):
            if w.pid == pid and w.host == socket.gethostname():
                client.delete(keys.worker_key(w.worker_id))
                client.srem(keys.WORKERS_INDEX, w.worker_id)
                log.info("unregistered %s worker %s (pid %d)", w.role, w.worker_id, pid)
    except redis.RedisError as exc:  # its TTL removes it anyway
        log.warning("could not unregister the worker of pid %d: %s", pid, exc)
    finally:
        client.close()


def _ready(base_url: str) -> int | None:
    """The process id of the gateway whose /ready said 200, or None. The gateway was given the models serve
    started (its config's startup_models and lazy_models): its /ready says 200 only once a request for each
    would be served."""
    try:
        with urllib.request.urlopen(f"{base_url}/ready", timeout=1) as resp:
            return int(json.load(resp)["gateway_pid"]) if resp.status == 200 else None
    except OSError:  # refused while the gateway starts, 503 (HTTPError) until the models are up
        return None
    except (ValueError, KeyError, TypeError):  # not our gateway's body: another server on the port
        return None


def _signal_all(procs: dict[str, subprocess.Popen]) -> None:
    """Every child but Redis, which the others need until they are gone (``EmbeddedRedis.stop`` stops it)."""
    for name, proc in procs.items():
        if name != STORE and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def _stop_all(procs: dict[str, subprocess.Popen], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM drains every process (in-flight requests finish, up to --drain-timeout), so they get that
    long plus STOP_GRACE_S; workers unregister from Redis on their way out."""
    _signal_all(procs)
    deadline = time.monotonic() + grace
    for name, proc in procs.items():
        if name == STORE:
            continue
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", name, grace)
            proc.kill()
            proc.wait()
