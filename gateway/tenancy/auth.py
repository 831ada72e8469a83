"""Who is asking: ``Authorization: Bearer <key>`` to a tenant for the API, to the admin for ``/admin``.

- ``/admin/...``: the admin key (``--admin-key`` / ``KVRELAY_ADMIN_KEY``), compared in constant time.
  No or a wrong key: 401. A valid tenant key: 403 (authenticated, not allowed). No admin key
  configured: 403, the admin API is off.
- the API (``/v1/...``, ``/tokenize``, ...): once any tenant exists, or an admin key is configured, a
  tenant key is required; missing, unknown or revoked: 401. Until then the gateway is open, as it was
  before tenants, and every request belongs to ``default_tenant`` with no limits.
- probes, metrics and the version stay open (``OPEN_PATHS``): orchestrators and scrapers carry no tenant key.

Keys are looked up on every request, not cached, so a revoked key stops working at once on every
replica. Keys are never logged; the error messages do not echo them either.
"""

import hmac
import logging
from collections.abc import Awaitable, Callable

import redis
from aiohttp import web

from kvrelay.gateway.errors import APIError
from kvrelay.gateway.redis_watch import redis_failed
from kvrelay.gateway.state import CONFIG
from kvrelay.gateway.tenancy.tenants import TENANTS, Tenant

log = logging.getLogger("kvrelay.gateway")
TENANT = web.RequestKey("tenant", Tenant)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers=_CHALLENGE)


def _store_unavailable(request: web.Request, exc: redis.RedisError) -> APIError:
    # an outage is logged once by the Redis watch (and marks the gateway unready); any other Redis error is
    # this request's to log, else a 503 would leave the operator nothing to read
    if not redis_failed(request.app, exc):
        log.warning("tenant store: redis error on %s %s: %s", request.method, request.path, exc)
    return APIError(503, "the tenant store is unavailable; retry later", code="auth_unavailable",
                    headers={"Retry-After": "1"})


async def _authorize_admin(request: web.Request) -> None:
    admin_key = request.app[CONFIG].admin_key
    token = bearer(request)
    if admin_key is None:
        raise APIError(403, "the admin API is disabled: start the gateway with --admin-key", code="admin_disabled")
    if token is None:
        raise _unauthorized("Missing admin key: send 'Authorization: Bearer <admin key>'")
    if hmac.compare_digest(token.encode(), admin_key.encode()):
        return
    try:
        tenant = await request.app[TENANTS].authenticate(token)
    except redis.RedisError as exc:
        raise _store_unavailable(request, exc) from None
    if tenant is not None:
        raise APIError(403, "API keys cannot use the admin API; use the admin key", code="admin_key_required")
    raise _unauthorized("Invalid admin key")


async def _tenant(request: web.Request) -> Tenant:
    config = request.app[CONFIG]
    store = request.app[TENANTS]
    token = bearer(request)
    try:
        if config.admin_key is None and not await store.enforced():
            return Tenant(name=config.default_tenant)  # open mode: whatever key the client sent is ignored
        if token is None:
            raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        tenant = await store.authenticate(token)
    except redis.RedisError as exc:
        raise _store_unavailable(request, exc) from None
    if tenant is None:
        raise _unauthorized("Invalid API key (unknown or revoked)")
    return tenant


@web.middleware
async def auth_middleware(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Inside error_middleware, so its 401/403 come out in OpenAI's error shape."""
    path = request.path
    if path == "/admin" or path.startswith("/admin/"):
        await _authorize_admin(request)
    elif path not in OPEN_PATHS:
        request[TENANT] = await _tenant(request)
    return await handler(request)
