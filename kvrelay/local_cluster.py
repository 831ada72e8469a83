"""Every kvrelay role as its own process on loopback (``python -m kvrelay.cli ROLE ...``), as production
runs them, against a Redis the caller provides: what the multi-process benchmarks start their stacks
with. Unlike ``kvrelay serve`` it starts any mix (two prefill workers, two gateways, ...), each with its
own flags, and says when everything is up."""

import json
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
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.loopback_ports import free_port
from kvrelay.shared.wire.protocol import WorkerInfo
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
        """Every worker registered in Redis with its models loaded, and every gateway's /ready saying 200 for
        those models. A gateway started without models is ready as soon as Redis answers, and reads the
        workers through a cache (--registry-cache-s), so its 200 alone may come from a reading before the
        workers: /v1/models would list nothing then."""
        deadline = time.monotonic() + timeout
        redis = sync_client(self.redis_url)
        try:
            published: dict[str, list[str]] = {}
            while len(published) < len(self.workers):
                self._check_alive()
                for w in set(self.workers) - set(published):
                    raw = redis.get(keys.worker_key(w))
                    if raw and (models := decode(raw, WorkerInfo).models):
                        published[w] = models
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {sorted(set(self.workers) - set(published))} have no model "
                                       f"loaded after {timeout} s")
                time.sleep(0.2)
        finally:
            redis.close()
        # a worker started with --model publishes the name clients use, the name /ready counts it under
        models = {m for ms in published.values() for m in ms}
        for port in self.gateway_ports.values():
            while not models <= _ready_models(f"http://127.0.0.1:{port}/ready"):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gateway on :{port} is not ready for {sorted(models)} after {timeout} s")
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


def _ready_models(url: str) -> set[str]:
    """The models a gateway's /ready counts as served, none unless it says 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return set(json.load(resp).get("models", {})) if resp.status == 200 else set()
    except (OSError, ValueError):
        return set()
