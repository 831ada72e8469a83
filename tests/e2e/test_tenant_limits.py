"""Tenant limits across two real gateway processes: one tenant's RPM, TPM and token quota hold for the
sum of what both admit, with requests sent to both at once, served by a real unified worker running a
tiny model; and either gateway reports the same usage."""

import asyncio
import shutil

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.e2e.cluster import Cluster
from tests.integration.tenant_harness import ADMIN_KEY, Admin, bearer

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--block-size", "8"]
MODEL = "tiny"
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 4
# ignore_eos: every admitted request generates exactly max_tokens, so it uses all it reserved
COST = len(PROMPT) + MAX_TOKENS


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tenants") / "tiny", seed=5)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture()
def two_gateways(tiny_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_dir), ENGINE + ["--served-model-name", MODEL], tmp_path)
    c.redis.flushall()
    ports = [c.start_gateway(name, ["--admin-key", ADMIN_KEY]) for name in ("gateway", "gateway2")]
    c.start_worker("unified", "u1")
    try:
        for port in ports:
            c.wait_ready(port=port)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        c.stop()
        c.redis.flushall()  # the session's Redis is shared: leave no tenant to lock out later tests


async def _burst(urls: list[str], key: str, count: int) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60, headers=bearer(key)) as http:
        return await asyncio.gather(*(http.post(f"{urls[i % 2]}/v1/completions", json=body) for i in range(count)))


def _admitted(responses: list[httpx.Response], reason_code: str) -> int:
    ok = [r for r in responses if r.status_code == 200]
    for r in responses:
        if r.status_code != 200:
            assert r.status_code == 429 and r.json()["error"]["code"] == reason_code, r.text
            assert int(r.headers["Retry-After"]) >= 1
    assert all(r.json()["usage"]["total_tokens"] == COST for r in ok)
    return len(ok)


def test_limits_hold_across_two_gateway_processes(two_gateways):
    admin, other_admin = Admin(two_gateways[0]), Admin(two_gateways[1])
    rpm, rpm_key = admin.tenant_with_key(rpm=5)
    tpm, tpm_key = admin.tenant_with_key(tpm=3 * COST)
    quota, quota_key = admin.tenant_with_key(quota_tokens=2 * COST + COST // 2)

    async def run():
        return await asyncio.gather(_burst(two_gateways, rpm_key, 12), _burst(two_gateways, tpm_key, 8),
                                    _burst(two_gateways, quota_key, 6))

    by_rpm, by_tpm, by_quota = asyncio.run(run())
    assert _admitted(by_rpm, "rate_limit_exceeded") == 5
    assert _admitted(by_tpm, "rate_limit_exceeded") == 3
    assert _admitted(by_quota, "insufficient_quota") == 2
    # usage written by both replicas, read from the other one
    totals = {u["tenant"]: (u["requests"], u["total_tokens"]) for u in other_admin.usage(model=MODEL)}
    assert totals == {rpm: (5, 5 * COST), tpm: (3, 3 * COST), quota: (2, 2 * COST)}
