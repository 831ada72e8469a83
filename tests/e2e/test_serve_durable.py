"""``kvrelay serve``'s control-plane state is durable (its embedded Redis keeps an append-only file in
--state-dir): real processes, a real redis-server. Tenants, API keys and admin-registered models survive
Ctrl-C and a start on the same folder (the old key answers 200), and a ``kill -9`` of serve; a second serve on that folder is one
line and exit 2 while the first keeps serving; and a ``kill -9`` of the embedded redis-server is undone
by serve's supervisor, after which requests are served again within a bound, and those whose jobs were
queued then are served from the file rather than failed with queue_lost. What that costs (seconds,
failed requests) is printed for README's operations section: ``pytest -s``."""

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from tests.e2e.cluster import free_port
from tests.e2e.conftest import TINY_ENGINE, TINY_POOL_ENGINE
from tests.e2e.served import Served

pytestmark = pytest.mark.slow
RECOVERY_BOUND_S = 120.0  # generous for CI's two loaded cores: past it, serving did not come back
REQUEST_TIMEOUT_S = 30.0


def _complete(client: openai.OpenAI) -> None:
    got = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 2


def _redis_server(served: Served) -> psutil.Process | None:
    """serve's live redis-server."""
    for child in psutil.Process(served.proc.pid).children():
        try:
            if child.name() == "redis-server" and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.NoSuchProcess:
            pass
    return None


def test_tenants_keys_and_registered_models_survive_a_restart_of_serve(tmp_path, tiny_model_dir):
    repo = ModelRepository(tmp_path / "repo")
    import_model(repo, str(tiny_model_dir), "extra", progress=False)
    state = tmp_path / "state"
    argv = ["--model", str(tiny_model_dir), *TINY_POOL_ENGINE, "--model-repo", str(repo.root)]
    with Served(argv, tmp_path / "serve-1.log", state_dir=state) as first:
        client = first.client()  # a tenant and its API key, made through the admin API
        status, body = first.admin("POST", "/admin/models", {"name": "extra", "version": 1})
        assert status == 201, body
        _complete(client)

        # a second serve on the same folder: refused in one line before it starts anything
        second = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--model", "dummy:tiny-llama",
                                 "--port", str(free_port()), "--state-dir", str(state)], capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.splitlines() == [
            f"kvrelay serve: error: --state-dir {state}: in use by another kvrelay serve (pid {first.proc.pid}); "
            "stop it, or give this one its own --state-dir"], second.stderr
        _complete(client)  # the first one never noticed
    assert first.proc.returncode == 0, first.log.read_text()[-3000:]  # Ctrl-C's SIGINT: a clean stop

    with Served(argv, tmp_path / "serve-2.log", state_dir=state) as again:
        old_key = openai.OpenAI(base_url=f"http://127.0.0.1:{again.port}/v1", api_key=client.api_key,
                                max_retries=0, timeout=REQUEST_TIMEOUT_S)
        _complete(old_key)  # 200: the key made before the restart still authenticates
        with pytest.raises(openai.AuthenticationError):  # and keys are still checked
            _complete(openai.OpenAI(base_url=old_key.base_url, api_key="sk-not-a-key", max_retries=0))
        extra = again.models().get("extra", {})
        assert extra.get("registered") and extra.get("version") == 1, again.models()
        status, body = again.admin("GET", "/admin/tenants")
        assert status == 200 and "tests" in str(body), body
        again.proc.kill()  # serve killed outright: the kernel sends its children SIGTERM
        again.proc.wait(10)

    with Served(argv, tmp_path / "serve-3.log", state_dir=state) as third:  # waits for the old Redis to go
        _complete(openai.OpenAI(base_url=f"http://127.0.0.1:{third.port}/v1", api_key=client.api_key,
                                max_retries=0, timeout=REQUEST_TIMEOUT_S))
        assert third.models().get("extra", {}).get("registered"), third.models()


def test_a_redis_server_killed_with_9_is_restarted_and_requests_recover(tmp_path, tiny_model_dir):
    with Served(["--model", str(tiny_model_dir), *TINY_ENGINE], tmp_path / "serve.log",
                state_dir=tmp_path / "state") as served:
        client = served.client()
        client = client.with_options(timeout=REQUEST_TIMEOUT_S)
        _complete(client)
        killed = _redis_server(served)
        assert killed is not None
        failed, sent = [], 0
        killed.kill()
        t0 = time.monotonic()
        restarted_after = recovered_after = None
        while recovered_after is None:
            elapsed = time.monotonic() - t0
            assert elapsed < RECOVERY_BOUND_S, (f"not serving {elapsed:.0f}s after the kill; failures: {failed[-3:]}\n"
                                                f"{served.log.read_text()[-4000:]}")
            if restarted_after is None and (server := _redis_server(served)) and server.pid != killed.pid:
                restarted_after = elapsed
            sent += 1
            try:
                _complete(client)
                recovered_after = time.monotonic() - t0
            except openai.APIError as exc:
                failed.append(f"{type(exc).__name__}: {getattr(exc, 'status_code', '')} {exc}"[:200])
                time.sleep(0.05)
        for _ in range(10):  # and it stays up: the next requests are all served
            _complete(client)
        server = _redis_server(served)
        assert server is not None and server.pid != killed.pid
        restarted_after = restarted_after if restarted_after is not None else recovered_after
        log = served.log.read_text()
        assert len(re.findall(r"redis exited with code -9; restarting it in 0\.05s", log)) == 1, log[-4000:]
        assert len(re.findall(r"redis started again \(pid \d+\)", log)) == 1, log[-4000:]
        # only Redis was restarted: the gateway and the workers rode it out
        assert not re.search(r"(gateway|worker\S*) exited with code", log), log[-4000:]
        print(f"\nkill -9 of the embedded redis-server under kvrelay serve: a new one ran within "
              f"{restarted_after:.2f}s; requests served again {recovered_after:.2f}s after the kill; "
              f"{len(failed)} of {sent} sequential requests failed meanwhile: {sorted(set(failed))}")


def _workers(served: Served) -> list[psutil.Process]:
    return [p for p in psutil.Process(served.proc.pid).children() if any(a.endswith("-worker") for a in p.cmdline())]


def _queue_depth(served: Served) -> float:
    text = httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=10).text
    found = re.search(r'^kvrelay_queue_depth\{[^}]*model="tiny"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_requests_queued_when_redis_is_killed_are_served_from_its_file(tmp_path, tiny_model_dir):
    """The jobs are in the append-only file when the redis-server is killed, so the gateway, asking the
    new server for them, lets their requests wait instead of failing them with queue_lost; the workers,
    stopped (SIGSTOP) until the new server is seen, then serve them."""
    argv = ["--model", str(tiny_model_dir), *TINY_ENGINE, "--reclaim-idle-ms", "1500"]
    with Served(argv, tmp_path / "serve.log", state_dir=tmp_path / "state") as served:
        client = served.client().with_options(timeout=120)
        _complete(client)
        workers = _workers(served)
        assert workers, [p.cmdline() for p in psutil.Process(served.proc.pid).children()]
        with ThreadPoolExecutor(3) as pool:
            for w in workers:
                w.suspend()
            try:
                futures = [pool.submit(_complete, client) for _ in range(3)]
                deadline = time.monotonic() + RECOVERY_BOUND_S
                while _queue_depth(served) < 3:  # answered XADDs: Redis wrote them to its file first
                    assert time.monotonic() < deadline, [f.exception() for f in futures if f.done()]
                    time.sleep(0.2)
                killed = _redis_server(served)
                killed.kill()
                while "redis restarted (run_id" not in served.log.read_text(errors="replace"):
                    assert time.monotonic() < deadline, served.log.read_text()[-4000:]
                    time.sleep(0.1)
                time.sleep(3.0)  # a request looks at its state every second: long enough to have failed
                assert not any(f.done() for f in futures), [f.exception() for f in futures if f.done()]
            finally:
                for w in workers:
                    w.resume()
            for f in futures:
                f.result()  # 200 and its two tokens, from the server restarted from its file
