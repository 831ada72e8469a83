"""How a tenant appears in the ``tenant`` label of /metrics, on gateways and workers alike.

Both /metrics endpoints are open (scrapers carry no key), so by default a tenant is shown as the first 12
hex digits of sha256(salt, name): the same on every gateway and worker of a deployment and across
restarts, so dashboards still sum and join per tenant, but a scrape neither names tenants nor confirms a
guessed name. The salt is random, made once per deployment by the first process to start and kept in
Redis (``METRICS_SALT``); it is never a tenant's ``cache_salt``, which keys that tenant's prefix cache.
An operator maps a label back with ``tenant_hash(salt, name)``. ``--metrics-tenant-labels`` shows names.
"""

import functools
import hashlib
import secrets
from collections.abc import Callable

from kvrelay.shared.wire.redis_keys import METRICS_SALT

HASH_HEX_DIGITS = 12  # 48 bits: no collision among a deployment's tenants, short enough for a legend


def tenant_hash(salt: str, tenant: str) -> str:
    # the separator keeps (salt "ab", tenant "c") and (salt "a", tenant "bc") apart
    return hashlib.sha256(f"{salt}\0{tenant}".encode()).hexdigest()[:HASH_HEX_DIGITS]


def tenant_labeler(salt: str | None) -> Callable[[str], str]:
    """name -> label: the hash under ``salt``; the name itself when ``salt`` is None (names shown)."""
    if salt is None:
        return str
    return functools.lru_cache(maxsize=4096)(lambda tenant: tenant_hash(salt, tenant))


def _decoded(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def metrics_salt(redis) -> str:
    """The deployment's salt, made here if no process made it before (SET NX: every process agrees)."""
    redis.set(METRICS_SALT, secrets.token_hex(16), nx=True)
    return _decoded(redis.get(METRICS_SALT))


async def metrics_salt_async(redis) -> str:
    await redis.set(METRICS_SALT, secrets.token_hex(16), nx=True)
    return _decoded(await redis.get(METRICS_SALT))
