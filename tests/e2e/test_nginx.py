"""Real nginx, running deploy/nginx/nginx.conf itself (only its upstream, listen and file paths rewritten
for loopback), in front of two real gateways with real workers on a tiny model.

* 1,000 concurrent streaming requests through nginx all complete, and both gateways take a share;
* killing one gateway under load: every request sent after the kill succeeds (nginx fails over), and
  the only failures are requests that were in flight at the kill, which fail fast and cleanly (a 502
  JSON error or a cut stream), never a hang;
* nginx's own errors (body or headers too large) come back as OpenAI-shaped JSON.
"""

import asyncio
import os
import re
import shutil
import time

import httpx
import pytest

from kvrelay.nginx import loopback_nginx
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.sse_client import many_streams_session, stream_completion_on

pytestmark = pytest.mark.slow
CONCURRENT = 1000
CLIENT_TIMEOUT_S = 120  # far above any honest answer here: reaching it means something hung


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is missing: .ci/run installs it (apt-get install -y nginx)")
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    return found


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    nginx = nginx_binary()
    logs = tmp_path_factory.mktemp("nginx")
    with EmbeddedRedis() as redis_url:
        c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, logs)
        try:
            ports = [c.start_gateway("g1"), c.start_gateway("g2")]
            c.start_worker("prefill", "p1")
            c.start_worker("decode", "d1")
            port = free_port()
            with loopback_nginx(nginx, ports, port, logs / "nginx-run", logs / "nginx.log"):
                for p in ports:
                    c.wait_ready(port=p)
                _wait_http(f"http://127.0.0.1:{port}/nginx-health")
                yield c, f"http://127.0.0.1:{port}", ports
        finally:
            c.stop()


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def body(i: int, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": [5 + i % 300, 6, 7], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "stream_options": {"include_usage": True}}


def served_by(port: int) -> int:
    """Completions a gateway answered 200, from its own /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    pattern = r'kvrelay_http_requests_total\{[^}]*route="/v1/completions"[^}]*status="200"[^}]*\} (\S+)'
    return sum(int(float(v)) for v in re.findall(pattern, text))


def test_nginx_streams_1000_concurrent_requests_without_error(stack):
    c, base, ports = stack
    before = [served_by(p) for p in ports]

    async def run():
        # a connection limit like a real load generator's: the 1,000 requests queue in the client beyond it
        async with many_streams_session(250, CLIENT_TIMEOUT_S) as session:
            return await asyncio.gather(*(stream_completion_on(session, f"{base}/v1/completions", body(i, 4))
                                          for i in range(CONCURRENT)))

    results = asyncio.run(run())
    errors = [r for r in results if not (r.ok and r.finish_reason == "length" and r.completion_tokens == 4)]
    assert not errors, f"{len(errors)} of {CONCURRENT} failed, e.g. {errors[:3]}"
    share = [served_by(p) - b for p, b in zip(ports, before, strict=True)]
    assert sum(share) == CONCURRENT and min(share) > 0, share  # least_conn used both


def test_nginx_answers_its_own_errors_in_openai_shape(stack):
    _, base, _ = stack
    big = httpx.post(f"{base}/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    huge_header = httpx.post(f"{base}/v1/completions", json=body(0, 2), headers={"x-padding": "a" * 20_000})
    assert huge_header.status_code == 431 and huge_header.json()["error"]["code"] == "header_too_large"
    ok = httpx.get(f"{base}/v1/models")
    assert ok.status_code == 200 and ok.headers.get("x-request-id")  # nginx's id reached the gateway and back


def test_killing_a_gateway_under_load_fails_over(stack):
    c, base, ports = stack
    url = f"{base}/v1/completions"

    async def run():
        async with many_streams_session(200, CLIENT_TIMEOUT_S) as http:
            started = [asyncio.Event() for _ in range(200)]
            before = [asyncio.create_task(stream_completion_on(http, url, body(i, 40), first_chunk=e))
                      for i, e in enumerate(started)]
            async with asyncio.timeout(60):
                while sum(e.is_set() for e in started) < 60:  # under load: many streams mid-generation
                    await asyncio.sleep(0.02)
            c.kill("g1")
            after = [asyncio.create_task(stream_completion_on(http, url, body(i, 8))) for i in range(200)]
            return await asyncio.gather(*before), await asyncio.gather(*after)

    before, after = asyncio.run(run())
    failed_after = [r for r in after if not r.ok]
    assert not failed_after, f"{len(failed_after)} requests sent after the kill failed: {failed_after[:3]}"
    failed_before = [r for r in before if not r.ok]
    for r in failed_before:
        # in flight on the dead gateway: a 502 from nginx (JSON, retryable) or a stream cut short;
        # a timeout here would be a hang
        clean = (r.status == 502 and r.code == "bad_gateway") or (
            r.status == 200 and r.error and "Timeout" not in r.error)
        assert clean, r
    assert len(failed_before) < len(before), "every in-flight request failed: nothing survived on g2"
    # the survivor keeps serving new requests alone
    ok = httpx.post(url, json={**body(1, 4), "stream_options": None}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
