"""A real kvrelay deployment for tests: an embedded redis-server and every role as its own process
(``python -m kvrelay.cli ...``), exactly as production runs them, on loopback."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.loopback_ports import free_port
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None




# How often a wait for a process to come up looks again: every start of a stack waits out half of it on average,
# and the suite starts a few hundred; a look is a file read, a Redis GET or one local HTTP request.
UP_POLL_S = 0.05

_RUN_CLI = "\nimport sys\nfrom kvrelay.cli import main\nsys.exit(main(sys.argv[1:]))\n"


class Cluster:
    def __init__(self, redis_url: str, model: str, engine_args: list[str], log_dir: Path):
        self.redis_url = redis_url
        self.model = model
        self.engine_args = engine_args
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = 0
        self.gateway_ports: dict[str, int] = {}
        self.redis = sync_client(redis_url)
        self.share_dir = Path(tempfile.mkdtemp(prefix="kvrelay-test-weights-", dir=_SHM))

    def _spawn(self, name: str, argv: list[str], redis_url: str | None = None, prelude: str = "") -> subprocess.Popen:
        """``prelude``: Python run in the child before the CLI (a test's stand-in for a broken part)."""
        log = open(self.log_dir / f"{name}.log", "wb")
        # several processes share CI's 2 cores: one math thread each avoids oversubscription stalls
        # the URL holds a password: the environment, not argv, which every local user can read
        # shared weights are counted per device: this cluster's workers share only among themselves, not with
        # the clusters of test files running alongside on this host
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KVRELAY_REDIS_URL=redis_url or self.redis_url,
                   KVRELAY_SHARE_WEIGHTS_DIR=str(self.share_dir))
        run = [sys.executable, "-P", "-c", prelude + _RUN_CLI] if prelude else [sys.executable, "-m", "kvrelay.cli"]
        proc = subprocess.Popen([*run, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def start_gateway(self, name: str = "gateway", extra: list[str] = ()) -> int:
        port = free_port()
        self._spawn(name, ["gateway", "--port", str(port), *extra])
        self.gateway_ports[name] = port
        if not self.port:
            self.port = port
        return port

    def start_worker(self, role: str, name: str, extra: list[str] = (), prelude: str = "") -> None:
        self._spawn(name, [f"{role}-worker", "--model", self.model, "--worker-id", name, *self.engine_args, *extra],
                    prelude=prelude)

    @contextlib.contextmanager
    def disaggregated(self, gateway_extra: list[str] = ()) -> Iterator["Cluster"]:
        """A gateway, prefill worker p1 and decode worker d1, ready; every process stopped after."""
        self.start_gateway(extra=gateway_extra)
        self.start_worker("prefill", "p1")
        self.start_worker("decode", "d1")
        try:
            self.wait_ready()
            yield self
        finally:
            self.stop()

    def start_unified_as_roles(self, role_url: Callable[[str], str], gateway_extra: list[str] = ()) -> int:
        """Unified worker u1 as Redis's worker user and a gateway as its gateway user (``role_url(user)``: that
        user's URL), ready; the gateway's port."""
        self.redis_url = role_url("worker")
        self.start_worker("unified", "u1")
        self.redis_url = role_url("gateway")
        port = self.start_gateway(extra=gateway_extra)
        self.wait_ready()
        return port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout: float = 120.0, port: int | None = None) -> None:
        """Every started worker registered, and the gateway says ready."""
        for name in self.procs:
            if "-" not in name and name[0] in "pdu":  # worker ids in these tests: p1, d1, u1, ...
                self.wait_worker(name, timeout)
        port = port or self.port
        url = f"http://127.0.0.1:{port}/ready"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.log(name)}")
            if not self._listening(port):  # another server's /ready on that port must not pass for ours
                time.sleep(UP_POLL_S)
                continue
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(UP_POLL_S)
        raise TimeoutError(f"not ready after {timeout}s:\n" + "\n".join(self.log(n)[-2000:] for n in self.procs))

    def _listening(self, port: int) -> bool:
        """Our gateway on ``port`` said it bound it (a port started some other way is taken on trust)."""
        names = [n for n, p in self.gateway_ports.items() if p == port]
        return not names or any(f"gateway listening on http://127.0.0.1:{port}\n" in self.log(n) for n in names)

    def wait_worker(self, worker_id: str, timeout: float = 120.0) -> WorkerInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.worker(worker_id)
            if info is not None:
                return info
            if self.procs[worker_id].poll() is not None:
                raise RuntimeError(f"{worker_id} exited early:\n{self.log(worker_id)}")
            time.sleep(UP_POLL_S)
        raise TimeoutError(f"{worker_id} never registered")

    def worker(self, worker_id: str) -> WorkerInfo | None:
        raw = self.redis.get(keys.worker_key(worker_id))
        return None if raw is None else decode(raw, WorkerInfo)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.share_dir, ignore_errors=True)
