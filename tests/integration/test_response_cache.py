"""The opt-in response cache: deterministic, non-streamed requests come back byte for byte without a
worker, are counted (metrics and usage), and are never served to another tenant."""

import pytest
import requests

from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.tenant_label import metrics_salt, tenant_hash
from tests.integration.gateway_harness import MODEL, REPLY, running_stack
from tests.integration.tenant_harness import ADMIN_KEY, Admin, bearer, sample, scrape, unique

pytestmark = pytest.mark.timeout(120)
TTL_S = 60


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("cache"), admin_key=ADMIN_KEY, response_cache_ttl=TTL_S) as s:
        yield s


@pytest.fixture
def admin(stack):
    return Admin(stack.url)


def _post(stack, key: str, body: dict, path: str = "/v1/completions") -> requests.Response:
    resp = requests.post(f"{stack.url}{path}", json=body, headers=bearer(key), timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def _jobs(stack, prompt_marker: str) -> int:
    return sum(1 for j in list(stack.worker.jobs) if prompt_marker in stack.tokenizer.decode(j.prompt_token_ids))


def test_hit_returns_the_identical_response_without_a_worker(stack, admin):
    name, key = admin.tenant_with_key()
    marker = unique("p")
    body = {"model": MODEL, "prompt": f"hello {marker}", "max_tokens": 64, "temperature": 0}
    before = scrape(stack.url)
    first = _post(stack, key, body)
    assert first.headers["X-Kvrelay-Cache"] == "miss" and first.json()["choices"][0]["text"] == REPLY
    # the same request written differently: defaults spelled out, keys reordered, an ignored field
    again = _post(stack, key, {"top_p": 1.0, "temperature": 0.0, "prompt": f"hello {marker}", "model": MODEL,
                               "max_tokens": 64, "user": "someone"})
    assert again.headers["X-Kvrelay-Cache"] == "hit"
    assert again.content == first.content  # same bytes: id and created included
    assert again.headers["Content-Type"] == first.headers["Content-Type"]
    assert _jobs(stack, marker) == 1
    after = scrape(stack.url)
    label = tenant_hash(metrics_salt(sync_client(stack.redis_url)), name)  # /metrics shows tenants hashed
    assert sample(after, "kvrelay_response_cache_hits_total", tenant=label) - \
        sample(before, "kvrelay_response_cache_hits_total", tenant=label) == 1
    assert sample(after, "kvrelay_response_cache_misses_total", tenant=label) - \
        sample(before, "kvrelay_response_cache_misses_total", tenant=label) == 1
    (usage,) = admin.usage(tenant=name)
    served = first.json()["usage"]
    # a hit is a request, not tokens: no worker computed anything for it
    assert (usage["requests"], usage["cache_hits"]) == (2, 1)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (served["prompt_tokens"],
                                                                     served["completion_tokens"])
    r = sync_client(stack.redis_url)
    (entry,) = list(r.scan_iter(match=f"kvrelay:respcache:{name}:*"))
    assert 0 < r.pttl(entry) <= TTL_S * 1000
    r.close()


def test_never_served_across_tenants(stack, admin):
    _, key_a = admin.tenant_with_key()
    name_b, key_b = admin.tenant_with_key()
    marker = unique("p")
    body = {"model": MODEL, "prompt": f"hi {marker}", "max_tokens": 8, "temperature": 0}
    a = _post(stack, key_a, body)
    b = _post(stack, key_b, body)
    assert b.headers["X-Kvrelay-Cache"] == "miss" and b.json()["id"] != a.json()["id"]
    assert _jobs(stack, marker) == 2
    assert _post(stack, key_b, body).content == b.content  # each tenant hits its own entry
    assert _post(stack, key_a, body).content == a.content
    assert _jobs(stack, marker) == 2
    assert admin.usage(tenant=name_b)[0]["cache_hits"] == 1


def test_only_deterministic_non_streamed_requests_are_cached(stack, admin):
    _, key = admin.tenant_with_key()
    marker = unique("p")
    prompt = f"the dog {marker}"
    seeded = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.8, "seed": 11}
    first = _post(stack, key, seeded)
    assert _post(stack, key, seeded).content == first.content
    assert _post(stack, key, {**seeded, "seed": 12}).headers["X-Kvrelay-Cache"] == "miss"
    sampled = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.8}
    assert "X-Kvrelay-Cache" not in _post(stack, key, sampled).headers
    assert "X-Kvrelay-Cache" not in _post(stack, key, sampled).headers
    streamed = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    assert _post(stack, key, streamed).text.rstrip().endswith("data: [DONE]")
    _post(stack, key, streamed)
    # two seeds (the repeat of the first was a hit), two unseeded, two streamed
    assert _jobs(stack, marker) == 2 + 2 + 2


def test_chat_and_completions_are_separate_entries(stack, admin):
    _, key = admin.tenant_with_key()
    marker = unique("p")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": marker}], "max_tokens": 6, "temperature": 0}
    first = _post(stack, key, chat, "/v1/chat/completions")
    again = _post(stack, key, chat, "/v1/chat/completions")
    assert again.headers["X-Kvrelay-Cache"] == "hit" and again.content == first.content
    assert again.json()["object"] == "chat.completion"
    completion = _post(stack, key, {"model": MODEL, "prompt": marker, "max_tokens": 6, "temperature": 0})
    assert completion.headers["X-Kvrelay-Cache"] == "miss"
