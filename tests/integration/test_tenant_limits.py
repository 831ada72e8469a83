"""Per-tenant RPM, TPM and token quota through two gateways sharing one Redis (as replicas do), and the
usage endpoint's numbers against what the responses reported. Requests go to both gateways at once:
the limits hold for their sum, exactly, because admission is one atomic Redis script."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.tenant_label import metrics_salt, tenant_hash
from tests.integration.gateway_harness import MODEL, GatewayServer, gateway_config, running_stack
from tests.integration.tenant_harness import ADMIN_KEY, Admin, assert_openai_error, bearer, sample, scrape

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """The harness's gateway plus a second replica on the same Redis and fake worker."""
    with running_stack(tmp_path_factory.mktemp("limits"), admin_key=ADMIN_KEY) as stack:
        second = GatewayServer(gateway_config(stack.redis_url, admin_key=ADMIN_KEY)).start()
        try:
            yield stack, second
        finally:
            second.stop()


@pytest.fixture
def admin(gateways):
    return Admin(gateways[0].url)


def _fan_out(urls: list[str], key: str, bodies: list[dict]) -> list[requests.Response]:
    """Every body at once, alternating between the gateways."""
    def post(i: int) -> requests.Response:
        return requests.post(f"{urls[i % len(urls)]}/v1/completions", json=bodies[i], headers=bearer(key), timeout=60)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, range(len(bodies))))


def _split(responses: list[requests.Response]) -> tuple[list, list]:
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(limited) == len(responses), [r.text for r in responses]
    return ok, limited


def _cost(stack, prompt: str, max_tokens: int) -> int:
    return len(stack.tokenizer.encode(prompt)) + max_tokens


def test_rpm_is_shared_by_two_gateways(gateways, admin):
    stack, second = gateways
    name, key = admin.tenant_with_key(rpm=4)
    urls = [stack.url, second.url]
    before = [scrape(u) for u in urls]
    ok, limited = _split(_fan_out(urls, key, [{"model": MODEL, "prompt": "hi", "max_tokens": 2}] * 10))
    assert (len(ok), len(limited)) == (4, 6)
    for resp in limited:
        error = assert_openai_error(resp, 429, "rate_limit_exceeded")
        assert error["type"] == "rate_limit_error" and "RPM" in error["message"]
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
    labels = {"tenant": tenant_hash(metrics_salt(sync_client(stack.redis_url)), name), "reason": "rpm"}
    after = [scrape(u) for u in urls]
    assert sum(sample(a, "kvrelay_rate_limited_total", **labels) - sample(b, "kvrelay_rate_limited_total", **labels)
               for a, b in zip(after, before, strict=True)) == 6


def test_tpm_is_shared_by_two_gateways(gateways, admin):
    stack, second = gateways
    prompt, max_tokens = "[slow] go", 5  # [slow]: the fake worker keeps them in flight together
    cost = _cost(stack, prompt, max_tokens)
    _, key = admin.tenant_with_key(tpm=3 * cost)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    ok, limited = _split(_fan_out([stack.url, second.url], key, [body] * 8))
    assert len(ok) == 3
    assert sum(r.json()["usage"]["total_tokens"] for r in ok) == 3 * cost
    for resp in limited:
        assert "TPM" in assert_openai_error(resp, 429, "rate_limit_exceeded")["message"]
        assert 1 <= int(resp.headers["Retry-After"]) <= 60


def test_tpm_reserves_max_tokens_and_refunds_what_was_not_generated(gateways, admin):
    stack, _ = gateways
    limit, max_tokens = 150, 80  # the fake reply is about 30 tokens: most of each reservation comes back
    _, key = admin.tenant_with_key(tpm=limit)
    reserve = _cost(stack, "hi", max_tokens)
    used, admitted = 0, 0
    for _ in range(10):
        resp = requests.post(f"{stack.url}/v1/completions", headers=bearer(key),
                             json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens})
        if resp.status_code == 429:
            break
        assert resp.status_code == 200, resp.text
        admitted += 1
        used += resp.json()["usage"]["total_tokens"]
    # refused exactly when what was used plus this request's reservation would pass the limit
    assert used <= limit < used + reserve
    assert admitted > limit // reserve  # more fit than the reservations alone: the unused part came back


def test_request_larger_than_the_limit_is_refused_without_retry_after(gateways, admin):
    stack, _ = gateways
    _, key = admin.tenant_with_key(tpm=30)
    resp = requests.post(f"{stack.url}/v1/completions", headers=bearer(key),
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 60})
    assert_openai_error(resp, 429, "request_too_large")
    assert "Retry-After" not in resp.headers


def test_quota_is_shared_by_two_gateways(gateways, admin):
    stack, second = gateways
    max_tokens = 3  # the reply is longer, and ignore_eos: every admitted request uses exactly its reservation
    cost = _cost(stack, "hi", max_tokens)
    name, key = admin.tenant_with_key(quota_tokens=2 * cost + cost // 2, quota_period_s=86400)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}
    to_midnight_at_most = 86400 - time.time() % 86400  # seconds to 00:00 UTC as the requests leave...
    ok, limited = _split(_fan_out([stack.url, second.url], key, [body] * 6))
    to_midnight_at_least = 86400 - time.time() % 86400  # ...and once every answer is in, however late
    assert len(ok) == 2
    for resp in limited:
        assert_openai_error(resp, 429, "insufficient_quota")
        # each refusal was made in between; 1 s either side for the whole seconds of Redis's TIME
        assert to_midnight_at_least - 1 <= int(resp.headers["Retry-After"]) <= to_midnight_at_most + 1
    assert admin.usage(tenant=name)[0]["total_tokens"] == 2 * cost


def test_usage_matches_what_was_served(gateways, admin):
    stack, second = gateways
    start = time.time()
    name, key = admin.tenant_with_key(rpm=3)
    bodies = [{"model": MODEL, "prompt": "hi", "max_tokens": 2},
              {"model": MODEL, "prompt": "hello there", "max_tokens": 64},
              {"model": MODEL, "prompt": "the lazy dog", "max_tokens": 5, "n": 2}]
    served = [requests.post(f"{url}/v1/completions", json=b, headers=bearer(key))
              for url, b in zip([stack.url, second.url, stack.url], bodies, strict=True)]
    assert [r.status_code for r in served] == [200, 200, 200]
    refused = requests.post(f"{second.url}/v1/completions", json=bodies[0], headers=bearer(key))
    assert refused.status_code == 429  # refused requests are not usage
    requests.post(f"{stack.url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=bearer(key))
    end = time.time()
    usages = [r.json()["usage"] for r in served]
    expected = {"tenant": name, "model": MODEL, "requests": 3, "cache_hits": 0,
                "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
                "completion_tokens": sum(u["completion_tokens"] for u in usages),
                "total_tokens": sum(u["total_tokens"] for u in usages)}
    assert admin.usage(tenant=name, start=start - 1, end=end + 1) == [expected]
    assert admin.usage(tenant=name, model=MODEL) == [expected]  # default range: the last 24 h
    assert expected in admin.usage()  # every tenant
    other = Admin(second.url).usage(tenant=name, model="other-model")
    assert other == [{**expected, "model": "other-model", "requests": 0, "prompt_tokens": 0,
                      "completion_tokens": 0, "total_tokens": 0}]
    assert admin.usage(tenant=name, start=start - 7200, end=start - 3600) == []  # nothing then
    assert_openai_error(admin.call("GET", "/admin/usage", params={"start": 10, "end": 5}), 400)
    assert_openai_error(admin.call("GET", "/admin/usage", params={"start": "yesterday"}), 400)
