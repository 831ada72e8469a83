"""The whole Redis Cluster gone (every node ``kill -9``) under a real gateway and worker, then back empty on
the same ports: while it is gone a request gets a quick 503 with Retry-After and ``/health`` says the
store is unreachable, no process exits, and once it is back the same processes serve again (the worker
registers anew, its stream's consumer group is made again), as with one Redis."""

import time

import httpx
import pytest

from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.slow
ENGINE = ["--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20)]
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


def test_the_cluster_gone_and_back(own_cluster, tmp_path):
    c = Cluster(own_cluster.url, "dummy:tiny-llama", ENGINE, tmp_path)
    c.start_gateway()
    c._spawn("u1", ["unified-worker", "--model", "dummy:tiny-llama", "--worker-id", "u1", *ENGINE],
             redis_url=own_cluster.role_url("worker"))
    try:
        c.wait_ready(timeout=120)
        base = f"http://127.0.0.1:{c.port}"
        with httpx.Client(timeout=60) as http:
            assert http.post(f"{base}/v1/completions", json=BODY).status_code == 200
            own_cluster.kill_all()
            deadline = time.monotonic() + 30
            while (reply := http.post(f"{base}/v1/completions", json=BODY)).status_code == 200:
                assert time.monotonic() < deadline, "still served with no Redis node"
            assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1, reply.text
            deadline = time.monotonic() + 30
            while (health := http.get(f"{base}/health")).status_code == 200:
                assert time.monotonic() < deadline, "health still ok with no Redis node"
            assert health.json()["error"]["code"] == "store_unavailable"

            own_cluster.restart_all()
            deadline = time.monotonic() + 60
            while (reply := http.post(f"{base}/v1/completions", json=BODY)).status_code != 200:
                assert reply.status_code in (503, 404), reply.text  # until the worker registered again
                assert time.monotonic() < deadline, (reply.text, c.log("u1")[-2000:])
                time.sleep(0.3)
            assert reply.json()["usage"]["completion_tokens"] == 4
            deadline = time.monotonic() + 60  # /health answers from the Redis watch's last probe
            while http.get(f"{base}/health").status_code != 200:
                assert time.monotonic() < deadline, "health not ok with the cluster back"
                time.sleep(0.2)
        assert all(proc.poll() is None for proc in c.procs.values())
    finally:
        c.stop()
        c.redis.close()
