"""``kvrelay serve`` started as a user starts it, for tests: one real process tree (its own embedded Redis
unless the flags name one, keeping its data in a state folder of the test's, never the user's; its workers
sharing weights among themselves alone), up once it prints its ready line, stopped with Ctrl-C's signal; plus
the admin API and a tenant's openai client against it, and what it says of itself when a test fails."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from kvrelay.shared.config.handover import module_argv
from tests.e2e.cluster import UP_POLL_S, free_port

ADMIN_KEY = "admin-key-for-serve-tests-0123456789"


def start_serve(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``kvrelay serve *argv`` in exactly ``env``, its output in ``log``; ``until_ready`` waits for it."""
    with open(log, "wb") as out:
        return subprocess.Popen([*module_argv("kvrelay.cli"), "serve", *argv], stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def until_ready(proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    """Until serve printed its ready line; an assertion error with its log if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while b"kvrelay ready" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(UP_POLL_S)


def stop_serve(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """``sig`` (Ctrl-C's unless said) to serve if it still runs; killed if it has not ended 60 s later."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Served:
    """``kvrelay serve *argv --port P --state-dir D`` (D without --redis-url) with ``KVRELAY_ADMIN_KEY`` set; a
    context manager.
    ``state_dir``: the embedded Redis's folder (give the same one to start again on its data), else a
    new one beside ``log``: tests running at once never share one.
    Its workers share weights in the folder serve gives its own deployment (kvrelay/weight_scope.py), never
    one named in the test run's environment: across stacks, a stack's workers would map the weights of whichever
    stack of a test running alongside loaded the model first, and on a GPU exit when that stack stops."""

    def __init__(self, argv: list[str], log: Path, cwd: Path | None = None, timeout: float = 180.0,
                 state_dir: Path | None = None):
        self.argv, self.log, self.cwd, self.timeout = argv, log, cwd, timeout
        self.state_dir = state_dir or Path(tempfile.mkdtemp(prefix="state-", dir=log.parent))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """The environment serve starts in (its workers inherit it)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", KVRELAY_ADMIN_KEY=ADMIN_KEY)
        env.pop("KVRELAY_SHARE_WEIGHTS_DIR", None)
        return env

    def __enter__(self) -> "Served":
        env = self.env()
        with open(self.log, "wb") as out:
            # an external Redis (--redis-url) keeps its own data: serve refuses --state-dir beside it
            state = [] if "--redis-url" in self.argv else ["--state-dir", str(self.state_dir)]
            self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "serve", *self.argv,
                                          "--port", str(self.port), *state],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd, env=env)
        deadline = time.monotonic() + self.timeout
        while b"kvrelay ready" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"kvrelay serve did not come up:\n{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(UP_POLL_S)
        return self

    def __exit__(self, *_exc) -> None:
        stop_serve(self.proc)

    def admin(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {ADMIN_KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=180) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def client(self, timeout: float = 180) -> openai.OpenAI:
        """An openai client with a tenant's key: with an admin key set, the API wants one."""
        status, body = self.admin("POST", "/admin/tenants", {"name": "tests"})
        assert status == 201, body
        status, body = self.admin("POST", "/admin/keys", {"tenant": "tests"})
        assert status == 201, body
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=body["key"], max_retries=0,
                             timeout=timeout)

    def state(self) -> str:
        """What the stack says of itself now, for a failing test's message: /ready's answer, each worker as the
        gateway sees it (``GET /admin/models``: live, its step's age, stalled) and the end of serve's log, where a
        worker that exited says why and serve says it restarted it."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=30) as resp:
                ready = f"{resp.status} {resp.read().decode(errors='replace')}"
        except urllib.error.HTTPError as exc:
            ready = f"{exc.code} {exc.read().decode(errors='replace')}"
        except OSError as exc:
            ready = f"no answer: {exc}"
        try:
            status, body = self.admin("GET", "/admin/models")
            workers = json.dumps({"status": status, "workers": body.get("workers"),
                                  "refused_workers": body.get("refused_workers"),
                                  "models": [{k: m.get(k) for k in ("name", "instances")} for m in body.get("data", [])]})
        except OSError as exc:
            workers = f"no answer: {exc}"
        lines = self.log.read_text(errors="replace").splitlines()
        # the access log's lines would push out what matters: the workers' and serve's own
        tail = [line for line in lines if "aiohttp.access" not in line][-60:]
        return f"GET /ready: {ready}\nGET /admin/models: {workers}\nserve log (access lines left out):\n" + "\n".join(tail)

    def models(self) -> dict[str, dict]:
        """``GET /admin/models`` by name."""
        status, body = self.admin("GET", "/admin/models")
        assert status == 200, body
        return {m["name"]: m for m in body["data"]}
