"""``kvrelay serve`` with its embedded Redis: each child talks to Redis as its role's least-privilege user
(the gateway as ``gateway``, the workers as ``worker``), a request is served that way, and no Redis
password is in any process's argv or environment, nor in serve's log."""

import os
import signal
from pathlib import Path

import openai
import psutil
import pytest

from kvrelay.shared.wire.redis_conn import sync_client
from tests.e2e.cluster import free_port
from tests.e2e.served import start_serve, stop_serve, until_ready

pytestmark = pytest.mark.slow
TINY = ["--max-model-len", "256", "--kv-cache-memory", str(16 << 20)]


def _embedded_redis(serve: psutil.Process) -> tuple[psutil.Process, dict[str, str]]:
    """The redis-server serve started, and each user's password, read from its private config file."""
    server = next(p for p in serve.children(recursive=True) if "redis-server" in p.name())
    users = {}
    for line in (Path(server.cwd()) / "redis.conf").read_text().splitlines():  # it works in its state dir
        if line.startswith("user "):
            users[line.split()[1]] = next(t[1:] for t in line.split() if t.startswith(">"))
    return server, users


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
def test_children_use_their_roles_users_and_no_password_leaks(tmp_path, mode):
    port, log, state = free_port(), tmp_path / "serve.log", tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_REDIS_URL"} | {"PYTHONUNBUFFERED": "1"}
    proc = start_serve(["--port", str(port), "--model", "dummy:tiny-llama", "--served-model-name", "tiny", "--mode",
                        mode, *TINY, "--state-dir", str(state)], log, env)
    try:
        until_ready(proc, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4

        serve = psutil.Process(proc.pid)
        server, passwords = _embedded_redis(serve)
        assert set(passwords) == {"default", "gateway", "worker"} and all(len(p) >= 32 for p in passwords.values())
        processes = [serve, *serve.children(recursive=True)]
        assert len(processes) >= (5 if mode == "disaggregated" else 4)  # serve, redis-server, gateway, workers
        for p in processes:
            seen = " ".join(p.cmdline()) + " ".join(f"{k}={v}" for k, v in p.environ().items())
            assert not [user for user, pw in passwords.items() if pw in seen], p.cmdline()
        assert not [user for user, pw in passwords.items() if pw in log.read_text()]
        assert f"unix://default:***@{state}/redis.sock" in log.read_text()

        assert Path(server.cwd()) == state.resolve()
        admin = sync_client(f"unix://default:{passwords['default']}@{state}/redis.sock")
        users = {c["user"] for c in admin.client_list() if c["id"] != str(admin.client_id())}
        assert users == {"gateway", "worker"}, admin.client_list()
    finally:
        stop_serve(proc, signal.SIGTERM)
