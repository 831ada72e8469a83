"""``kvrelay serve --redis-url redis-cluster://...`` (issue 28): no embedded Redis; its gateway and worker use
a real three-master Redis Cluster, and an unreachable cluster is one line at start, its password not shown."""

import os
import signal
import subprocess
import sys

import openai
import pytest

from tests.e2e.cluster import free_port
from tests.e2e.served import start_serve, until_ready
from tests.e2e.test_redis_cluster import ADMIN_KEY, admin

pytestmark = pytest.mark.slow


def test_kvrelay_serve_on_the_cluster(redis_cluster, tmp_path):
    redis_cluster.flushall()
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVRELAY_REDIS_URL=redis_cluster.url)
    proc = start_serve(["--port", str(port), "--model", "dummy:tiny-llama", "--served-model-name", "serve-tiny",
                        "--mode", "unified", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20),
                        "--admin-key", ADMIN_KEY], log, env)
    try:
        until_ready(proc, log)
        assert "redis-cluster://admin:***@127.0.0.1:" in log.read_text()
        assert admin(port, "POST", "/admin/tenants", {"name": "serve-tests"})[0] in (200, 201)
        status, body = admin(port, "POST", "/admin/keys", {"tenant": "serve-tests"})
        assert status == 201, body
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=body["key"], max_retries=0, timeout=60)
        # ignore_eos: a model of random weights may pick the end token first, which says nothing of the cluster
        done = client.completions.create(model="serve-tiny", prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        redis_cluster.flushall()
    closed = f"redis-cluster://admin:hunter2-not-shown@127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--model", "dummy:tiny-llama", "--port",
                           str(free_port())], env=dict(env, KVRELAY_REDIS_URL=closed), capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("kvrelay serve: error: --redis-url redis-cluster://admin:***@127.0.0.1:")
    assert "Redis unreachable" in lines[0] and "hunter2" not in done.stderr + done.stdout
