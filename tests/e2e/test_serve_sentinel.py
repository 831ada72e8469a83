"""``kvrelay serve`` with an external Redis behind Sentinel (``$KVRELAY_REDIS_URL`` a ``redis+sentinel://``
URL): it checks the master through the sentinels before it starts anything, hands the URL to every child,
serves, logs the URL without its passwords, and keeps serving after the master is killed with -9 (the
sentinels promote the replica; no child is restarted)."""

import os
import time

import openai
import pytest

from tests.e2e.cluster import free_port
from tests.e2e.sentinel_redis import SentinelRedis
from tests.e2e.served import start_serve, stop_serve, until_ready

pytestmark = pytest.mark.slow
TINY = ["--max-model-len", "256", "--kv-cache-memory", str(16 << 20)]
RESUME_BOUND_S = 120.0  # a hang bound, not a speed claim


def test_serve_follows_the_master_through_a_failover(tmp_path):
    ha = SentinelRedis().start()
    port, log = free_port(), tmp_path / "serve.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1", "KVRELAY_REDIS_URL": ha.url}
    proc = start_serve(["--port", str(port), "--model", "dummy:tiny-llama", "--served-model-name", "tiny", "--mode",
                        "unified", *TINY, "--redis-outage-s", "10"], log, env)
    try:
        until_ready(proc, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)

        def complete() -> int:
            return client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0).usage.completion_tokens

        assert complete() == 4
        old = ha.master_port()
        killed = time.monotonic()
        ha.kill_master()
        failed = 0
        while True:
            try:
                assert complete() == 4
                break
            except openai.APIStatusError as exc:  # a clean, retryable answer while no master is known
                assert exc.status_code == 503 and exc.response.headers.get("retry-after"), exc
                failed += 1
                assert time.monotonic() - killed < RESUME_BOUND_S, "serving did not resume"
                time.sleep(0.1)
        resumed = time.monotonic() - killed
        # serving resumed, so some sentinel named the replica; the one master_port() asks may learn it a moment later
        ha._wait(lambda: ha.master_port() != old, "the sentinels naming the new master")
        print(f"\n[serve, Sentinel] served again {resumed:.2f} s after the master's kill -9 ({failed} quick 503s)")
        text = log.read_text(errors="replace")
        shown = ha.url.replace(ha.passwords["default"], "***").replace(ha.sentinel_password, "***")
        assert shown in text
        assert ha.passwords["default"] not in text and ha.sentinel_password not in text
        assert "; restarting it in" not in text and "started again" not in text, text[-3000:]  # no child restarted
        assert "Traceback" not in text, text[-3000:]
    finally:
        stop_serve(proc)
        ha.stop()
