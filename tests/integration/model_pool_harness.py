"""What the model control plane's tests run against: the real gateway app on a real port with a model
repository and an admin key, and workers as a fast scripted layer. A ``ScriptedWorker`` heartbeats a
loading-capable WorkerInfo and answers ControlCommands; a load it accepts starts an ``InstanceWorker`` (a
FakeWorker, gateway_harness.py) that serves the instance's stream. Real worker processes are tested end to
end in tests/e2e.
"""

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import requests

from kvrelay.gateway.control.reconciler import RECONCILER
from kvrelay.shared.repo.model_repo import MANIFEST
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult, InstanceStatus, WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import (
    THREAD_BOUND_S,
    FakeWorker,
    GatewayServer,
    build_tokenizer,
    gateway_config,
)

ADMIN_KEY = "admin-key-0123456789abcdef"
# a hang bound, not a speed claim: a scripted load builds a tokenizer, which takes seconds on a busy machine
LOAD_BOUND_S = 60.0


@dataclasses.dataclass
class InstanceWorker(FakeWorker):
    """A FakeWorker serving one repository instance ("name@3") under its client name. It does not
    heartbeat: the ScriptedWorker that loaded it reports the instance, in its own role."""

    served: str = ""
    version: int = 0
    holder: str = ""  # the ScriptedWorker's id: registered and heartbeating, as a real worker serving it is

    @property
    def holder_id(self) -> str:
        return self.holder

    def model_info(self):
        return dataclasses.replace(super().model_info(), served_name=self.served, version=self.version)

    def _heartbeat(self, r) -> None:
        pass


class ScriptedWorker:
    """Heartbeats like a worker started with --model-repo and obeys load/unload. ``refuse`` answers every
    load with that error; clearing ``gate`` holds loads in state "loading" until it is set again."""

    def __init__(self, redis_url: str, tokenizer_dir: Path, worker_id: str, role: str = "unified",
                 refuse: str = ""):
        self.redis_url, self.tokenizer_dir, self.worker_id, self.role = redis_url, tokenizer_dir, worker_id, role
        self.refuse = refuse
        self.gate = threading.Event()
        self.gate.set()
        self.commands: list[ControlCommand] = []
        self.states: dict[str, InstanceStatus] = {}
        self.serving: dict[str, InstanceWorker] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._loads: list[threading.Thread] = []  # stop waits for them: a load finishing after it would leave a
        # fake worker reading the instance's stream, taking the next test's jobs
        self._redis = sync_client(redis_url)

    def start(self) -> "ScriptedWorker":
        self._heartbeat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.gate.set()
        for thread in [self._thread, *self._loads]:
            thread.join(THREAD_BOUND_S)
            assert not thread.is_alive(), f"{self.worker_id}: {thread.name} did not stop"
        for worker in list(self.serving.values()):
            worker.stop()
        self._redis.delete(keys.worker_key(self.worker_id))
        self._redis.srem(keys.WORKERS_INDEX, self.worker_id)

    def ops(self, op: str) -> list[ControlCommand]:
        with self._lock:
            return [c for c in self.commands if c.op == op]

    def _heartbeat(self) -> None:
        with self._lock:
            states = list(self.states.values())
        info = WorkerInfo(worker_id=self.worker_id, role=self.role, zmq_addr="tcp://127.0.0.1:1",
                          models=[s.instance for s in states if s.state == "ready"], free_blocks=100,
                          total_blocks=100, running=0, waiting=0, pid=0, host="test", started=time.time(),
                          heartbeat=time.time(), instances=states, weights_budget=1 << 30,
                          weights_used=len(states) << 20, can_load=True)
        self._redis.set(keys.worker_key(self.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
        self._redis.sadd(keys.WORKERS_INDEX, self.worker_id)

    def _answer(self, cmd: ControlCommand, ok: bool, error: str = "") -> None:
        result = ControlResult(command_id=cmd.command_id, worker_id=self.worker_id, instance=cmd.instance, ok=ok,
                               error=error)
        self._redis.set(keys.control_result_key(cmd.command_id), encode(result), ex=keys.CONTROL_RESULT_TTL_S)

    def _load(self, cmd: ControlCommand) -> None:
        self.gate.wait()
        if self._stop.is_set():
            return
        worker = InstanceWorker(self.redis_url, self.tokenizer_dir, model=cmd.instance,
                                worker_id=f"{self.worker_id}/{cmd.instance}", served=cmd.name,
                                version=cmd.version, holder=self.worker_id).start()
        with self._lock:
            self.serving[cmd.instance] = worker
            self.states[cmd.instance].state = "ready"
        self._heartbeat()
        self._answer(cmd, True)

    def _handle(self, cmd: ControlCommand) -> None:
        with self._lock:
            self.commands.append(cmd)
        if cmd.op == "load":
            if self.refuse:
                return self._answer(cmd, False, self.refuse)
            with self._lock:
                if cmd.instance in self.states:  # idempotent, like the real worker
                    return self._answer(cmd, True)
                self.states[cmd.instance] = InstanceStatus(instance=cmd.instance, name=cmd.name, version=cmd.version,
                                                           state="loading", pinned=cmd.pinned)
            self._heartbeat()
            self._loads.append(threading.Thread(target=self._load, args=(cmd,), daemon=True))
            self._loads[-1].start()
        else:
            with self._lock:
                self.states.pop(cmd.instance, None)
                worker = self.serving.pop(cmd.instance, None)
            if worker is not None:
                worker.stop()
            self._heartbeat()
            self._answer(cmd, True)

    def _run(self) -> None:
        beat = time.monotonic()
        while not self._stop.is_set():
            data = self._redis.rpop(keys.control_key(self.worker_id))
            if data is not None:
                self._handle(decode(data, ControlCommand))
                continue
            if time.monotonic() - beat > 0.5:
                self._heartbeat()
                beat = time.monotonic()
            time.sleep(0.02)


def own_db(url: str, db: int = 7) -> str:
    """A logical database of its own on the session Redis: these tests flush it freely."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return urlunsplit(parts._replace(query=f"db={db}"))
    return urlunsplit(parts._replace(path=f"/{db}"))


def add_version(repo: Path, name: str, version: int) -> None:
    folder = repo / name / str(version)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({
        "name": name, "version": version, "dtype": "float32", "max_model_len": 96, "architecture": "LlamaForCausalLM",
        "files": {}, "source": "test", "created": 0.0}))


@dataclasses.dataclass
class Env:
    redis_url: str
    tokenizer_dir: Path
    server: GatewayServer
    api_key: str

    @property
    def url(self) -> str:
        return self.server.url

    def admin(self, method: str, path: str, **kw) -> requests.Response:
        return requests.request(method, f"{self.url}{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                timeout=60, **kw)

    def complete(self, model: str, prompt: str = "hello there") -> requests.Response:
        return requests.post(f"{self.url}/v1/completions", headers={"Authorization": f"Bearer {self.api_key}"},
                             json={"model": model, "prompt": prompt, "max_tokens": 64}, timeout=60)

    def worker(self, worker_id: str, **kw) -> ScriptedWorker:
        return ScriptedWorker(self.redis_url, self.tokenizer_dir, worker_id, **kw).start()

    def reconcile(self) -> bool:
        app = self.server.app
        return asyncio.run_coroutine_threadsafe(app[RECONCILER].run_once(), self.server.loop).result(60)

    def model(self, name: str) -> dict | None:
        data = self.admin("GET", "/admin/models").json()["data"]
        return next((m for m in data if m["name"] == name), None)


def until(predicate: Callable[[], object], what: str, bound_s: float = 15.0) -> None:
    """A bound on waiting for something asynchronous, not a timing assertion."""
    end = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.05)




@contextlib.contextmanager
def model_pool(redis_url: str, repo: Path, tmp: Path, db: int, **config) -> Iterator[Env]:
    """The gateway on logical database ``db`` (flushed first) of the session Redis, registering from
    ``repo``, with tenant t1 and its API key; the reconciler runs only when a test calls it. ``config``:
    gateway settings of the test's own."""
    url = own_db(redis_url, db)
    sync_client(url).flushdb()
    server = GatewayServer(gateway_config(url, **{"admin_key": ADMIN_KEY, "model_repo": str(repo),
                                                  "model_load_timeout": LOAD_BOUND_S, "reconcile_interval_s": 0.0,
                                                  **config})).start()
    try:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert requests.post(f"{server.url}/admin/tenants", json={"name": "t1"}, headers=headers).status_code == 201
        key = requests.post(f"{server.url}/admin/keys", json={"tenant": "t1"}, headers=headers).json()["key"]
        yield Env(url, build_tokenizer(tmp / "tokenizer"), server, key)
    finally:
        server.stop()
