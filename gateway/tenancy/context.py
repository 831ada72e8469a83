"""The tenancy room on the app: its cleanup context puts the tenant store, the rate limiter and the usage
ledger, all on the app's Redis, under their keys (``TENANTS``, ``LIMITER``, ``USAGE``)."""

from collections.abc import AsyncIterator

from aiohttp import web

from kvrelay.gateway.state import CONFIG, REDIS
from kvrelay.gateway.tenancy.limits import LIMITER, RateLimiter
from kvrelay.gateway.tenancy.tenants import TENANTS, TenantStore
from kvrelay.gateway.tenancy.usage import USAGE, UsageLedger


async def tenancy_ctx(app: web.Application) -> AsyncIterator[None]:
    client, config = app[REDIS], app[CONFIG]
    app[TENANTS] = TenantStore(client)
    app[LIMITER] = RateLimiter(client)
    app[USAGE] = UsageLedger(client, config.usage_retention_s)
    yield
