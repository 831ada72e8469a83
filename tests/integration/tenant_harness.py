"""Helpers for the multi-tenant gateway tests: an admin client over real HTTP, tenants with fresh keys,
and a Prometheus scrape parsed the way Prometheus parses it."""

import uuid

import requests
from prometheus_client.parser import text_string_to_metric_families

ADMIN_KEY = "test-admin-key-0123456789abcdef"


def unique(prefix: str = "t") -> str:
    """Tests share one Redis per module; a fresh tenant per test keeps their limits and usage apart."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Admin:
    def __init__(self, base_url: str, key: str = ADMIN_KEY):
        self.base_url = base_url
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {key}"

    def call(self, method: str, path: str, **kw) -> requests.Response:
        return self.http.request(method, f"{self.base_url}{path}", timeout=30, **kw)

    def put_tenant(self, name: str | None = None, **settings) -> str:
        name = name or unique()
        resp = self.call("POST", "/admin/tenants", json={"name": name, **settings})
        assert resp.status_code in (200, 201), resp.text
        return name

    def new_key(self, tenant: str) -> tuple[str, str]:
        resp = self.call("POST", "/admin/keys", json={"tenant": tenant})
        assert resp.status_code == 201, resp.text
        body = resp.json()
        return body["id"], body["key"]

    def tenant_with_key(self, **settings) -> tuple[str, str]:
        name = self.put_tenant(**settings)
        return name, self.new_key(name)[1]

    def usage(self, **query) -> list[dict]:
        resp = self.call("GET", "/admin/usage", params=query)
        assert resp.status_code == 200, resp.text
        return resp.json()["data"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``GET /metrics`` as {(sample name, labels): value}."""
    resp = requests.get(f"{base_url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def assert_openai_error(resp: requests.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error
