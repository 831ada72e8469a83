"""--tenant-kv-quota on a decode worker, with real processes: a gateway with two tenants' keys, a prefill worker
without a quota and a decode worker with one (tiny model, CPU, embedded Redis). Tenant A's concurrent requests
need more than its quota of the decode worker's KV together: they all complete, none fails, A never holds more
than its quota there at a grant, and its requests waited for it there; tenant B's requests, sent alongside,
complete without ever waiting for a quota."""

import asyncio

import httpx
import pytest

from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.integration.tenant_harness import ADMIN_KEY, Admin, bearer, scrape

pytestmark = pytest.mark.slow
MODEL = "tiny"  # TINY_ENGINE's --served-model-name
NUM_BLOCKS, BLOCK = 4096, 8  # TINY_ENGINE's --num-gpu-blocks-override and --block-size
QUOTA = 0.002  # 8.2 blocks of 4096
MAX_TOKENS = 16
# A: 40-token prompts, 5 blocks at a grant: one at a time fits its quota. B: 8-token prompts, 1 block at a grant
# and 3 once decoded: all of B's fit it at once
PROMPTS = {"A": list(range(5, 45)), "B": list(range(5, 13))}
COUNT = {"A": 4, "B": 3}


@pytest.fixture()
def cluster(tiny_model_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    c.redis.flushall()
    c.metrics_port = free_port()
    c.start_gateway(extra=["--admin-key", ADMIN_KEY])
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1", ["--tenant-kv-quota", str(QUOTA), "--monitoring-port", str(c.metrics_port),
                                    "--metrics-tenant-labels"])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()
        c.redis.flushall()  # the session's Redis is shared: leave no tenant behind


async def _send(base: str, keys: dict[str, str]) -> dict[str, list[httpx.Response]]:
    """Every tenant's requests at once."""
    async def post(http: httpx.AsyncClient, name: str) -> httpx.Response:
        body = {"model": MODEL, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS, "ignore_eos": True}
        return await http.post(f"{base}/v1/completions", json=body, headers=bearer(keys[name]))

    async with httpx.AsyncClient(timeout=120) as http:
        names = [name for name in keys for _ in range(COUNT[name])]
        answers = await asyncio.gather(*(post(http, name) for name in names))
    return {name: [a for n, a in zip(names, answers, strict=True) if n == name] for name in keys}


def test_a_tenant_over_its_decode_quota_waits_and_completes_and_others_do_not_wait(cluster):
    base = f"http://127.0.0.1:{cluster.port}"
    admin = Admin(base)
    tenants = {"A": admin.tenant_with_key(), "B": admin.tenant_with_key()}
    by_tenant = asyncio.run(_send(base, {name: key for name, (_, key) in tenants.items()}))
    for name, answers in by_tenant.items():
        assert [r.status_code for r in answers] == [200] * COUNT[name], (name, [r.text for r in answers])
        assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in answers)

    metrics = scrape(f"http://127.0.0.1:{cluster.metrics_port}")

    def of(metric: str, tenant: str) -> float:
        return metrics.get((metric, frozenset({"model_name": MODEL, "tenant": tenants[tenant][0]}.items())), 0.0)

    # A's requests did not all fit its quota at once: they waited on the decode worker, one held at a time
    assert of("kvrelay_handoff_quota_waits_total", "A") >= 1
    assert of("kvrelay_handoff_tenant_kv_blocks_peak", "A") <= QUOTA * NUM_BLOCKS
    assert of("kvrelay_handoff_quota_waits_total", "B") == 0 and of("kvrelay_handoff_tenant_kv_blocks_peak", "B") > 0
