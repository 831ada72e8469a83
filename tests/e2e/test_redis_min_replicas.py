"""``--redis-min-replicas``: the gateway's job writes wait (Redis WAIT, on their own connection) until a
replica has them, so a failover right after cannot lose them; when no replica confirms in time the request
still goes on, and the write is counted. Real processes (a gateway and a unified worker, their ACL users:
the gateway's may run WAIT) behind real sentinels, a real master and replica."""

import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.sentinel_redis import SentinelRedis

pytestmark = pytest.mark.slow
WAIT_MS = 300
REQUESTS = 4


def _unreplicated(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "kvrelay_job_writes_unreplicated"
               for s in f.samples if s.name.endswith("_total"))


def _complete(port: int) -> float:
    """Seconds one completion took; it must succeed."""
    started = time.monotonic()
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0})
    assert resp.status_code == 200, resp.text
    return time.monotonic() - started


def test_job_writes_wait_for_a_replica_and_count_when_none_confirms(tiny_model_dir, tmp_path):
    ha = SentinelRedis().start()
    c = Cluster(ha.url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    try:
        port = c.start_unified_as_roles(ha.role_url, ["--redis-min-replicas", "1", "--redis-replica-wait-ms",
                                                      str(WAIT_MS)])
        replica = ha.data_ports[1]
        with_replica = [_complete(port) for _ in range(REQUESTS)]
        assert _unreplicated(port) == 0  # the replica confirmed every job write
        ha.procs[replica].send_signal(signal.SIGSTOP)  # alive to the master, confirming nothing
        try:
            without = [_complete(port) for _ in range(REQUESTS)]
        finally:
            ha.procs[replica].send_signal(signal.SIGCONT)
        print(f"\n[--redis-min-replicas 1] completion with the replica confirming: "
              f"{1000 * min(with_replica):.0f}-{1000 * max(with_replica):.0f} ms; replica frozen: "
              f"{1000 * min(without):.0f}-{1000 * max(without):.0f} ms (wait {WAIT_MS} ms)")
        assert _unreplicated(port) == REQUESTS  # each unconfirmed job write counted, each request served
        assert min(without) >= WAIT_MS / 1000  # the wait happened: the request waited out the timeout
        assert "Traceback" not in c.log("gateway"), c.log("gateway")[-3000:]
    finally:
        c.stop()
        ha.stop()
