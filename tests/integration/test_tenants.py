"""Tenants and API keys through the real gateway, real Redis and the fake worker: the admin API and its
own key, keys shown once and stored only as hashes, 401/403/404 in OpenAI's shape, per-tenant model
lists, what each Job carries for its tenant, and the open mode while no tenant exists."""

import hashlib
import time

import openai
import pytest
import requests

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ModelInfo, WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import MODEL, REPLY, running_stack
from tests.integration.tenant_harness import ADMIN_KEY, Admin, assert_openai_error, bearer, unique

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("tenants"), admin_key=ADMIN_KEY, scheduling_policy="priority") as s:
        yield s


@pytest.fixture
def admin(stack):
    return Admin(stack.url)


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


def test_admin_api_needs_the_admin_key(stack, admin):
    name, key = admin.tenant_with_key()
    url = f"{stack.url}/admin/tenants"
    missing = requests.get(url)
    assert_openai_error(missing, 401, "invalid_api_key")
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    assert_openai_error(requests.get(url, headers=bearer("not-the-admin-key")), 401, "invalid_api_key")
    assert_openai_error(requests.get(url, headers={"Authorization": f"Basic {ADMIN_KEY}"}), 401)
    # a valid tenant key is authenticated, just not allowed
    assert_openai_error(requests.post(f"{stack.url}/admin/keys", json={"tenant": name}, headers=bearer(key)), 403,
                        "admin_key_required")
    assert_openai_error(requests.get(f"{stack.url}/admin/nothing-here"), 401)  # no route probing without a key
    listed = admin.call("GET", "/admin/tenants").json()["data"]
    mine = next(t for t in listed if t["name"] == name)
    assert "cache_salt" not in mine and mine["models"] == [] and mine["rpm"] is None


def test_tenant_validation_and_update(admin):
    bad = admin.call("POST", "/admin/tenants", json={"name": "has:colon"})
    assert assert_openai_error(bad, 400)["param"] == "name"
    typo = admin.call("POST", "/admin/tenants", json={"name": unique(), "rpn": 5})
    assert_openai_error(typo, 400)
    assert_openai_error(admin.call("POST", "/admin/tenants", json={"name": unique(), "rpm": 0}), 400)
    name = unique()
    first = admin.call("POST", "/admin/tenants", json={"name": name, "rpm": 5, "tpm": 1000})
    assert first.status_code == 201 and first.json()["rpm"] == 5
    again = admin.call("POST", "/admin/tenants", json={"name": name, "tpm": 2000, "priority": 3})
    assert again.status_code == 200
    assert (again.json()["rpm"], again.json()["tpm"], again.json()["priority"]) == (None, 2000, 3)
    assert again.json()["created"] == first.json()["created"]
    assert_openai_error(admin.call("POST", "/admin/keys", json={"tenant": unique()}), 404, "tenant_not_found")


def test_key_is_shown_once_and_only_its_hash_is_stored(stack, admin):
    name = admin.put_tenant()
    resp = admin.call("POST", "/admin/keys", json={"tenant": name})
    assert resp.status_code == 201 and resp.headers["Cache-Control"] == "no-store"
    body = resp.json()
    key, key_id = body["key"], body["id"]
    assert key.startswith("kvr-") and len(key) >= 40 and body["tenant"] == name
    listed = admin.call("GET", "/admin/keys", params={"tenant": name}).json()["data"]
    assert [k["id"] for k in listed] == [key_id] and "key" not in listed[0]
    # Nowhere in Redis, in any key name or value: only the SHA-256 is there
    r = sync_client(stack.redis_url)
    secret, digest = key.encode(), hashlib.sha256(key.encode()).hexdigest().encode()
    blobs = []
    for name_ in r.scan_iter(count=1000):
        blobs.append(name_)
        kind = r.type(name_)
        if kind == b"string":
            blobs.append(r.get(name_))
        elif kind == b"hash":
            blobs += [x for kv in r.hgetall(name_).items() for x in kv]
        elif kind == b"set":
            blobs += list(r.smembers(name_))
    r.close()
    assert not any(secret in b for b in blobs)
    assert any(digest in b for b in blobs)


def test_api_keys_authenticate_and_revoked_keys_stop_working(stack, admin):
    name, key = admin.tenant_with_key()
    url = f"{stack.url}/v1/completions"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    missing = requests.post(url, json=body)
    assert_openai_error(missing, 401, "invalid_api_key")
    unknown = requests.post(url, json=body, headers=bearer("kvr-" + "A" * 43))
    assert_openai_error(unknown, 401, "invalid_api_key")
    assert "kvr-AAAA" not in unknown.text  # a key is never echoed back
    with pytest.raises(openai.AuthenticationError):
        _client(stack, "kvr-nope").models.list()
    out = _client(stack, key).completions.create(model=MODEL, prompt="hello", max_tokens=64)
    assert out.choices[0].text == REPLY
    (key_id,) = [k["id"] for k in admin.call("GET", "/admin/keys", params={"tenant": name}).json()["data"]]
    assert admin.call("DELETE", f"/admin/keys/{key_id}").json() == {"object": "api_key", "id": key_id,
                                                                     "deleted": True}
    assert_openai_error(admin.call("DELETE", f"/admin/keys/{key_id}"), 404, "key_not_found")
    assert_openai_error(requests.post(url, json=body, headers=bearer(key)), 401, "invalid_api_key")
    assert_openai_error(requests.post(f"{stack.url}/tokenize", json={"prompt": "hi"}), 401)
    assert requests.get(f"{stack.url}/health").status_code == 200  # probes stay open


def test_models_a_tenant_may_not_use(stack, admin):
    r = sync_client(stack.redis_url)
    info = decode(r.get(keys.model_key(MODEL)), ModelInfo)
    info.name = "secret-model"
    r.set(keys.model_key(info.name), encode(info))
    r.sadd(keys.MODELS_INDEX, info.name)
    # a live worker holds it: /v1/models lists only what can be served
    now = time.time()
    worker = WorkerInfo(worker_id="secret-w", role="unified", models=[info.name], zmq_addr="tcp://127.0.0.1:1",
                        free_blocks=1, total_blocks=1, running=0, waiting=0, pid=1, host="h", started=now,
                        heartbeat=now)
    r.set(keys.worker_key(worker.worker_id), encode(worker), ex=60)
    r.sadd(keys.WORKERS_INDEX, worker.worker_id)
    try:
        _, limited = admin.tenant_with_key(models=[MODEL])
        _, everything = admin.tenant_with_key()
        assert [m.id for m in _client(stack, limited).models.list().data] == [MODEL]
        assert sorted(m.id for m in _client(stack, everything).models.list().data) == sorted([MODEL, info.name])
        url = f"{stack.url}/v1/completions"
        denied = requests.post(url, json={"model": info.name, "prompt": "hi"}, headers=bearer(limited))
        assert assert_openai_error(denied, 403, "model_not_allowed")["param"] == "model"
        with pytest.raises(openai.PermissionDeniedError):
            _client(stack, limited).chat.completions.create(model=info.name,
                                                            messages=[{"role": "user", "content": "hi"}])
        missing = requests.post(url, json={"model": "no-such-model", "prompt": "hi"}, headers=bearer(limited))
        assert_openai_error(missing, 404, "model_not_found")
        # with two models registered, "the only model" is the only one this tenant may use
        out = requests.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=bearer(limited))
        assert out.status_code == 200 and out.json()["model"] == MODEL
        # "" means the same as leaving it out; a tenant that may use both must name one
        out = requests.post(url, json={"model": "", "prompt": "hi", "max_tokens": 2}, headers=bearer(limited))
        assert out.status_code == 200 and out.json()["model"] == MODEL
        for body in ({"model": "", "prompt": "hi"}, {"prompt": "hi"}):
            both = requests.post(url, json=body, headers=bearer(everything))
            assert "several models" in assert_openai_error(both, 400)["message"]
            assert both.json()["error"]["param"] == "model"
        tok = requests.post(f"{stack.url}/tokenize", json={"model": info.name, "prompt": "hi"}, headers=bearer(limited))
        assert_openai_error(tok, 403)
    finally:
        r.delete(keys.model_key(info.name), keys.worker_key(worker.worker_id))
        r.srem(keys.MODELS_INDEX, info.name)
        r.srem(keys.WORKERS_INDEX, worker.worker_id)
        r.close()


def test_jobs_carry_tenant_priority_and_salt(stack, admin):
    a, key_a = admin.tenant_with_key(priority=5)
    b, key_b = admin.tenant_with_key()
    r = sync_client(stack.redis_url)
    salt_a, salt_b = (r.hget(keys.tenant_key(t), "cache_salt").decode() for t in (a, b))
    r.close()
    assert salt_a != salt_b and len(salt_a) >= 32

    def job_of(key: str, **extra):
        out = _client(stack, key).completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
        (job,) = stack.jobs_for(out.id.split("-", 1)[1])
        return job

    job = job_of(key_a)
    assert (job.tenant, job.priority, job.cache_salt) == (a, 5, salt_a)
    job = job_of(key_a, priority=-100, cache_salt="user-7")  # a client cannot jump its tenant's queue
    assert (job.priority, job.cache_salt) == (5, f"{salt_a}:user-7")
    assert job_of(key_a, priority=9).priority == 9  # ... but may ask to go later
    job = job_of(key_b)
    assert (job.tenant, job.priority, job.cache_salt) == (b, 0, salt_b)


def test_open_mode_until_a_tenant_exists(tmp_path):
    with running_stack(tmp_path, scheduling_policy="priority") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="anything", max_retries=0)
        out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": -3,
                                                                                            "cache_salt": "x"})
        (job,) = s.jobs_for(out.id.split("-", 1)[1])
        assert (job.tenant, job.priority, job.cache_salt) == ("default", -3, "x")
        assert_openai_error(requests.get(f"{s.url}/admin/tenants", headers=bearer(ADMIN_KEY)), 403, "admin_disabled")
        # another replica (one with the admin key) created a tenant: from now on keys are required here too
        r = sync_client(s.redis_url)
        r.hset(keys.tenant_key("acme"), mapping={"models": "[]", "priority": 0})
        r.sadd(keys.TENANTS_INDEX, "acme")
        r.close()
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
