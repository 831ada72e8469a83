"""Every kvrelay role as its own process on loopback (``python -m kvrelay.cli ROLE ...``), as production
runs them, against a Redis the caller provides: what the multi-process benchmarks start their stacks
with. Unlike ``kvrelay serve`` it starts any mix (two prefill workers, two gateways, ...), each with its
own flags, and says when everything is up."""

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvrelay import weight_scope
from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV, generate
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.loopback_ports import free_port
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.worker.weight_registry import Proc

SHARE_WEIGHTS_ENV = "KVRELAY_SHARE_WEIGHTS_DIR"  # --share-weights-dir's: a folder the caller chose is left as given


class LocalCluster:
    def __init__(self, redis_url: str, log_dir: Path, cli_flags: Sequence[str] = ()):
        """``cli_flags``: before the role, for every process (e.g. ``--log-level WARNING``)."""
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.cli_flags = list(cli_flags)
        self.procs: dict[str, subprocess.Popen] = {}
        self.gateway_ports: dict[str, int] = {}
        self.workers: list[str] = []
        # one deployment: its processes admit each other's ZMQ sockets and nobody else's
        self.zmq_secret = os.environ.get(ZMQ_SECRET_ENV) or generate()
        # and map each other's weights, never another stack's on this host (as serve's, kvrelay/weight_scope.py):
        # an importer's workers exit to reload when the exporter's stack stops, so a stack that turned ready beside
        # another one's stop would list no model for that moment
        self.share_dir: Path | None = None
        if SHARE_WEIGHTS_ENV not in os.environ:
            weight_scope.sweep()
            self.share_dir = weight_scope.deployment_dir(Proc.me())

    def env(self) -> dict[str, str]:
        """The environment its processes start in."""
        # processes sharing a few cores: one math thread each avoids oversubscription stalls
        # the URL holds a password: the environment, not argv, which every local user can read
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KVRELAY_REDIS_URL=self.redis_url,
                   **{ZMQ_SECRET_ENV: self.zmq_secret})
        if self.share_dir is not None:
            env[SHARE_WEIGHTS_ENV] = str(self.share_dir)
        return env

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen([*module_argv("kvrelay.cli"), *self.cli_flags, *argv],
                                                stdout=log, stderr=subprocess.STDOUT, env=self.env())

    def start_gateway(self, name: str = "gateway", extra: Sequence[str] = ()) -> int:
        port = free_port()
        self._spawn(name, ["gateway", "--port", str(port), *extra])
        self.gateway_ports[name] = port
        return port

    def start_worker(self, role: str, name: str, model: str, extra: Sequence[str] = ()) -> None:
        """``role``: prefill, decode or unified; ``name`` is its worker id."""
        self._spawn(name, [f"{role}-worker", "--model", model, "--worker-id", name,
                           *extra])
        self.workers.append(name)

    def base_url(self, gateway: str = "gateway") -> str:
        return f"http://127.0.0.1:{self.gateway_ports[gateway]}/v1"

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{self.log(name)[-4000:]}")

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Every worker registered in Redis and every gateway answering /ready."""
        deadline = time.monotonic() + timeout
        redis = sync_client(self.redis_url)
        try:
            waiting = set(self.workers)
            while waiting:
                self._check_alive()
                waiting = {w for w in waiting if not redis.exists(keys.worker_key(w))}
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {sorted(waiting)} not registered after {timeout} s")
                time.sleep(0.2)
        finally:
            redis.close()
        for port in self.gateway_ports.values():
            while not _answers(f"http://127.0.0.1:{port}/ready"):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gateway on :{port} is not ready after {timeout} s")
                time.sleep(0.2)

    def stop(self, grace: float = 20.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.share_dir is not None:  # after its workers: nothing maps it any more
            shutil.rmtree(self.share_dir, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
