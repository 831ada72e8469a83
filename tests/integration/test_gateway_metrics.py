"""``GET /metrics`` scraped over HTTP and parsed with prometheus_client's own parser: the counters,
histograms and gauges move as requests flow, vLLM's request-level series among them, and the queue
gauges read what is in Redis. (tests/e2e/test_api_metrics.py checks the vLLM series with real workers.)"""

import contextlib
import threading
import time

import pytest
import requests

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ModelInfo
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.tenant_label import metrics_salt, tenant_hash
from tests.integration.gateway_harness import MODEL, running_stack
from tests.integration.tenant_harness import ADMIN_KEY, Admin, bearer, sample, scrape

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("metrics"), admin_key=ADMIN_KEY, queue_metrics_cache_s=0.0) as s:
        yield s


def _delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def test_request_metrics_move(stack):
    name, key = Admin(stack.url).tenant_with_key()
    before = scrape(stack.url)
    out = requests.post(f"{stack.url}/v1/completions", headers=bearer(key),
                        json={"model": MODEL, "prompt": "hello there", "max_tokens": 64}).json()
    requests.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})  # 401
    requests.get(f"{stack.url}/v1/no-such-route", headers=bearer(key))  # 404
    after = scrape(stack.url)
    route = "/v1/completions"
    assert _delta(after, before, "kvrelay_http_requests_total", route=route, status="200") == 1
    assert _delta(after, before, "kvrelay_http_requests_total", route=route, status="401") == 1
    assert _delta(after, before, "kvrelay_http_requests_total", route="unmatched", status="404") == 1
    assert _delta(after, before, "kvrelay_http_request_duration_seconds_count", route=route) == 2
    assert _delta(after, before, "kvrelay_ttft_seconds_count", model=MODEL) == 1
    assert _delta(after, before, "kvrelay_ttft_seconds_sum", model=MODEL) > 0
    usage = out["usage"]
    # /metrics is open: the tenant shows as its hash under the deployment's salt, never by name
    label = tenant_hash(metrics_salt(sync_client(stack.redis_url)), name)
    assert _delta(after, before, "kvrelay_tenant_tokens_total", tenant=label, model=MODEL,
                  kind="prompt") == usage["prompt_tokens"]
    assert _delta(after, before, "kvrelay_tenant_tokens_total", tenant=label, model=MODEL,
                  kind="completion") == usage["completion_tokens"]
    assert name not in requests.get(f"{stack.url}/metrics").text
    assert sample(after, "kvrelay_requests_in_flight", model=MODEL) == 0


def test_tenant_names_show_only_with_metrics_tenant_labels(tmp_path):
    with running_stack(tmp_path, admin_key=ADMIN_KEY, metrics_tenant_labels=True) as named:
        name, key = Admin(named.url).tenant_with_key()
        requests.post(f"{named.url}/v1/completions", headers=bearer(key),
                      json={"model": MODEL, "prompt": "hello there", "max_tokens": 8})
        assert sample(scrape(named.url), "kvrelay_tenant_tokens_total", tenant=name, model=MODEL, kind="prompt") > 0


def test_vllm_request_series_count_each_choice_once(stack):
    _, key = Admin(stack.url).tenant_with_key()
    before = scrape(stack.url)
    outs = [requests.post(f"{stack.url}/v1/completions", headers=bearer(key),
                          json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 64, "n": 1 + i}).json()
            for i in range(3)]  # 1 + 2 + 3 choices
    after = scrape(stack.url)
    choices = [c for out in outs for c in out["choices"]]
    assert len(choices) == 6 and {c["finish_reason"] for c in choices} == {"stop"}
    prompt = sum(out["usage"]["prompt_tokens"] * len(out["choices"]) for out in outs)  # each choice is a request
    completion = sum(out["usage"]["completion_tokens"] for out in outs)
    m = {"model_name": MODEL}
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert _delta(after, before, f"{histogram}_count", **m) == 6, histogram
    assert _delta(after, before, "vllm:request_success_total", finished_reason="stop", **m) == 6
    assert _delta(after, before, "vllm:prompt_tokens_total", **m) == prompt
    assert _delta(after, before, "vllm:request_prompt_tokens_sum", **m) == prompt
    assert _delta(after, before, "vllm:generation_tokens_total", **m) == completion
    assert _delta(after, before, "vllm:request_generation_tokens_sum", **m) == completion
    # the fake worker sends one batch per step: every batch after a choice's first is one ITL sample
    assert 0 < _delta(after, before, "vllm:inter_token_latency_seconds_count", **m) <= completion - 6
    # vLLM's buckets: TTFT's first bound is 1 ms, e2e's 0.3 s, the token counts' 1-2-5 series
    assert ("vllm:time_to_first_token_seconds_bucket", frozenset({**m, "le": "0.001"}.items())) in after
    assert ("vllm:e2e_request_latency_seconds_bucket", frozenset({**m, "le": "0.3"}.items())) in after
    assert ("vllm:request_prompt_tokens_bucket", frozenset({**m, "le": "5000.0"}.items())) in after
    assert sample(after, "vllm:num_requests_running", **m) == 0
    assert sample(after, "vllm:num_requests_waiting", **m) == 0


def test_vllm_running_waiting_and_abort(stack):
    _, key = Admin(stack.url).tenant_with_key()
    m = {"model_name": MODEL}
    before = scrape(stack.url)

    def poll(name: str) -> float:
        deadline, seen = time.monotonic() + 10, 0.0
        while time.monotonic() < deadline and seen == 0:
            seen = sample(scrape(stack.url), name, **m)
        return seen

    # never answered: waiting until the client gives up, then an abort
    silent = threading.Thread(target=_post_until_timeout, args=(stack.url, key, "[silent] anyone?", 3.0))
    silent.start()
    assert poll("vllm:num_requests_waiting") == 1
    assert sample(scrape(stack.url), "vllm:num_requests_running", **m) == 0
    silent.join(30)
    # answered slowly: running once its first token is in
    slow = threading.Thread(target=requests.post, args=(f"{stack.url}/v1/completions",),
                            kwargs={"json": {"model": MODEL, "prompt": "[slow] please", "max_tokens": 30},
                                    "headers": bearer(key), "timeout": 60})
    slow.start()
    assert poll("vllm:num_requests_running") == 1
    slow.join(60)
    after = scrape(stack.url)
    assert sample(after, "vllm:num_requests_running", **m) == sample(after, "vllm:num_requests_waiting", **m) == 0
    assert _delta(after, before, "vllm:request_success_total", finished_reason="abort", **m) == 1
    assert _delta(after, before, "vllm:request_success_total", finished_reason="length", **m) == 1
    assert _delta(after, before, "vllm:e2e_request_latency_seconds_count", **m) == 1  # aborts have no latency


def test_a_servable_models_request_gauges_read_0_before_its_first_request(tmp_path):
    """As vLLM's from start-up: a dashboard's series exist, an alert on them does not start as "no data"."""
    with running_stack(tmp_path) as fresh:
        deadline = time.monotonic() + 60  # bounds a hang: the worker publishes its model as it starts
        while MODEL not in {m["id"] for m in requests.get(f"{fresh.url}/v1/models").json()["data"]}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        samples = scrape(fresh.url)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert samples[(name, frozenset({"model_name": MODEL}.items()))] == 0


def _post_until_timeout(url: str, key: str, prompt: str, timeout: float) -> None:
    with contextlib.suppress(requests.exceptions.Timeout):
        requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8},
                      headers=bearer(key), timeout=timeout)


def test_in_flight_requests(stack):
    _, key = Admin(stack.url).tenant_with_key()
    body = {"model": MODEL, "prompt": "[slow] please", "max_tokens": 30}
    thread = threading.Thread(target=requests.post, args=(f"{stack.url}/v1/completions",),
                              kwargs={"json": body, "headers": bearer(key), "timeout": 60})
    thread.start()
    seen = 0.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and seen == 0:
        seen = sample(scrape(stack.url), "kvrelay_requests_in_flight", model=MODEL)
    thread.join(60)
    assert seen == 1
    assert sample(scrape(stack.url), "kvrelay_requests_in_flight", model=MODEL) == 0


def test_queue_gauges_read_redis(stack):
    model = "queued-model"
    r = sync_client(stack.redis_url)
    info = decode(r.get(keys.model_key(MODEL)), ModelInfo)
    info.name = model
    r.set(keys.model_key(model), encode(info))
    r.sadd(keys.MODELS_INDEX, model)
    stream = keys.prefill_stream(model)
    now_ms = int(r.time()[0]) * 1000
    try:
        assert sample(scrape(stack.url), "kvrelay_queue_depth", model=model) == 0
        # three jobs queued before any worker existed, the first of them 30 s ago
        for i, age_ms in enumerate((30_000, 2_000, 1_000)):
            r.xadd(stream, {keys.JOB_FIELD: b"x"}, id=f"{now_ms - age_ms}-{i}")
        samples = scrape(stack.url)
        assert sample(samples, "kvrelay_queue_depth", model=model) == 3
        assert sample(samples, "kvrelay_queue_pending", model=model) == 0
        assert 30 <= sample(samples, "kvrelay_queue_oldest_age_seconds", model=model) < 300
        # a worker takes two and acknowledges one; one more is dead-lettered
        r.xgroup_create(stream, keys.PREFILL_GROUP, id="0")
        (_, taken), = r.xreadgroup(keys.PREFILL_GROUP, "w", {stream: ">"}, count=2)
        r.xack(stream, keys.PREFILL_GROUP, taken[0][0])
        r.xadd(keys.dead_letter_stream(model), {keys.JOB_FIELD: b"x", "reason": "poison"})
        samples = scrape(stack.url)
        assert sample(samples, "kvrelay_queue_depth", model=model) == 2  # one pending, one undelivered
        assert sample(samples, "kvrelay_queue_pending", model=model) == 1
        assert 2 <= sample(samples, "kvrelay_queue_oldest_age_seconds", model=model) < 30
        assert sample(samples, "kvrelay_dead_letter_total", model=model) == 1
        r.xack(stream, keys.PREFILL_GROUP, taken[1][0])
        r.xreadgroup(keys.PREFILL_GROUP, "w", {stream: ">"}, count=1)
        r.xack(stream, keys.PREFILL_GROUP, *[e for e, _ in r.xrange(stream)])
        samples = scrape(stack.url)
        assert sample(samples, "kvrelay_queue_depth", model=model) == 0
        assert sample(samples, "kvrelay_queue_oldest_age_seconds", model=model) == 0
    finally:
        r.delete(keys.model_key(model), stream, keys.dead_letter_stream(model))
        r.srem(keys.MODELS_INDEX, model)
        r.close()
