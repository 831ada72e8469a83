"""The admin API's handlers (admin key only, see ``auth.py``; routed in the gateway's ``routes.py``): tenants, their
API keys, and usage.

    POST   /admin/tenants     {name, models, rpm, tpm, quota_tokens, quota_period_s, priority}: create
                              (201) or update (200); null or absent limits are unlimited
    GET    /admin/tenants
    POST   /admin/keys        {tenant}: 201 with the key, the only time it is ever shown
    GET    /admin/keys[?tenant=]   key ids and owners, never keys
    DELETE /admin/keys/{id}   revoke: the key gets 401 on every replica from the next request
    GET    /admin/usage?tenant=&model=&start=&end=   totals per tenant and model; unix seconds,
                              default the last 24 h
"""

import logging
import time

import redis
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvrelay.gateway.bodies import read_json, validate
from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.gateway.state import CONFIG
from kvrelay.gateway.tenancy.tenants import NAME_RE, TENANTS, Tenant
from kvrelay.gateway.tenancy.usage import USAGE

log = logging.getLogger("kvrelay.gateway")

_NO_STORE = {"Cache-Control": "no-store"}  # a response carrying a key must not sit in any cache


class TenantBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt limit must fail loudly, not be unlimited
    name: str
    models: list[str] = Field(default_factory=list)
    rpm: StrictInt | None = Field(default=None, ge=1)
    tpm: StrictInt | None = Field(default=None, ge=1)
    quota_tokens: StrictInt | None = Field(default=None, ge=1)
    quota_period_s: StrictInt = Field(default=86400, ge=1)
    priority: StrictInt = 0


class KeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str


def _redis_down(exc: redis.RedisError) -> APIError:
    log.warning("admin API: redis unavailable: %s", exc)
    return APIError(503, "the tenant store is unavailable; retry later", code="store_unavailable",
                    headers={"Retry-After": "1"})


async def put_tenant(request: web.Request) -> web.Response:
    body = validate(TenantBody, await read_json(request))
    if not NAME_RE.match(body.name):
        raise bad_request("name must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                          "name")
    tenant = Tenant(name=body.name, models=sorted(set(body.models)), rpm=body.rpm, tpm=body.tpm,
                    quota_tokens=body.quota_tokens, quota_period_s=body.quota_period_s, priority=body.priority)
    try:
        stored, created = await request.app[TENANTS].put_tenant(tenant)
    except redis.RedisError as exc:
        raise _redis_down(exc) from None
    log.info("tenant %s %s", stored.name, "created" if created else "updated")
    return web.json_response({"object": "tenant", **stored.public()}, status=201 if created else 200)


async def list_tenants(request: web.Request) -> web.Response:
    try:
        tenants = await request.app[TENANTS].tenants()
    except redis.RedisError as exc:
        raise _redis_down(exc) from None
    return web.json_response({"object": "list", "data": [{"object": "tenant", **t.public()} for t in tenants]})


async def create_key(request: web.Request) -> web.Response:
    body = validate(KeyBody, await read_json(request))
    store = request.app[TENANTS]
    try:
        if await store.tenant(body.tenant) is None:
            raise APIError(404, f"no tenant named {body.tenant!r}", param="tenant", code="tenant_not_found")
        record, key = await store.issue_key(body.tenant)
    except redis.RedisError as exc:
        raise _redis_down(exc) from None
    log.info("issued API key %s for tenant %s", record.id, record.tenant)
    return web.json_response({"object": "api_key", "id": record.id, "tenant": record.tenant, "key": key,
                              "created": record.created}, status=201, headers=_NO_STORE)


async def list_keys(request: web.Request) -> web.Response:
    try:
        found = await request.app[TENANTS].keys(request.query.get("tenant") or None)
    except redis.RedisError as exc:
        raise _redis_down(exc) from None
    data = [{"object": "api_key", "id": k.id, "tenant": k.tenant, "created": k.created} for k in found]
    return web.json_response({"object": "list", "data": data})


async def delete_key(request: web.Request) -> web.Response:
    key_id = request.match_info["id"]
    try:
        revoked = await request.app[TENANTS].revoke_key(key_id)
    except redis.RedisError as exc:
        raise _redis_down(exc) from None
    if not revoked:
        raise APIError(404, f"no API key with id {key_id!r}", code="key_not_found")
    log.info("revoked API key %s", key_id)
    return web.json_response({"object": "api_key", "id": key_id, "deleted": True})


def _seconds(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(f"{name} must be unix seconds, got {raw!r}", name) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise bad_request(f"{name} must be a finite number", name)
    return value


async def usage(request: web.Request) -> web.Response:
    ledger = request.app[USAGE]
    end = _seconds(request, "end", time.time())
    start = _seconds(request, "start", end - 86400)
    if start > end:
        raise bad_request("start must not be after end", "start")
    if end - start > request.app[CONFIG].usage_retention_s:
        raise bad_request(f"the range may span at most {ledger.retention_s}s (usage retention)", "start")
    tenant, model = request.query.get("tenant") or None, request.query.get("model") or None
    if tenant is not None and not NAME_RE.match(tenant):
        raise bad_request(f"no tenant named {tenant!r}", "tenant")
    try:
        totals = await ledger.query(tenant, model, start, end)
    except redis.RedisError as exc:
        raise _redis_down(exc) from None
    return web.json_response({"object": "list", "start": start, "end": end, "data": [u.as_dict() for u in totals]})

