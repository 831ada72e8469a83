"""Tenants and their API keys, kept in Redis so every gateway replica sees the same ones at once.

An API key is ``kvr-`` plus 32 random bytes (URL-safe base64). It is shown once, when issued; Redis
holds only its SHA-256, under which the key record is found. An unsalted fast hash is enough here: the
key has 256 bits of entropy, so there is nothing to brute-force, and lookups stay one round trip.
Nothing in this module logs a key; key ids name keys in logs and in the admin API.
"""

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass, field

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.coalesced import Coalesced, CoalescedByKey
from kvrelay.shared.wire import redis_keys as keys

KEY_PREFIX = "kvr-"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # no ':' or braces: names go into key names
_LIMITS = ("rpm", "tpm", "quota_tokens")


@dataclass
class Tenant:
    name: str
    models: list[str] = field(default_factory=list)  # empty: every model
    rpm: int | None = None  # None: unlimited
    tpm: int | None = None
    quota_tokens: int | None = None
    quota_period_s: int = 86400
    # Scheduler priority, lower runs first (vLLM). None: the request's own priority goes through as sent,
    # which is what the open (keyless) mode does.
    priority: int | None = None
    cache_salt: str | None = None  # salts this tenant's prefix-cache blocks apart from everyone else's
    created: float = 0.0

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) for name in _LIMITS)

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models

    def job_priority(self, requested: int) -> int:
        """A client may ask to run later than its tenant's priority, never sooner: priority is something
        the operator grants, and lower numbers jump the queue."""
        return requested if self.priority is None else max(self.priority, requested)

    def job_cache_salt(self, requested: str | None) -> str | None:
        """The tenant's salt always applies; a client's own salt (per end user, say) splits it further."""
        if self.cache_salt is None:
            return requested
        return self.cache_salt if requested is None else f"{self.cache_salt}:{requested}"

    def public(self) -> dict:
        """The admin API's view: everything but the cache salt, which is internal."""
        return {"name": self.name, "models": self.models, "rpm": self.rpm, "tpm": self.tpm,
                "quota_tokens": self.quota_tokens, "quota_period_s": self.quota_period_s,
                "priority": self.priority, "created": self.created}

    @classmethod
    def from_hash(cls, name: str, raw: dict[bytes, bytes]) -> "Tenant":
        fields = {k.decode(): v.decode() for k, v in raw.items()}

        def number(key: str) -> int | None:
            value = int(fields.get(key) or 0)
            return value or None

        return cls(name=name, models=json.loads(fields.get("models") or "[]"), rpm=number("rpm"),
                   tpm=number("tpm"), quota_tokens=number("quota_tokens"),
                   quota_period_s=int(fields.get("quota_period_s") or 86400),
                   priority=int(fields.get("priority") or 0), cache_salt=fields.get("cache_salt"),
                   created=float(fields.get("created") or 0))


@dataclass
class ApiKey:
    id: str
    tenant: str
    created: float


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantStore:
    def __init__(self, client: redis.asyncio.Redis):
        self._redis = client
        # asked on every request: a burst shares its reads, each still sent after its callers arrived
        self.enforced = Coalesced(self._enforced)
        self._authenticate = CoalescedByKey(self._owner)  # by key digest: one tenant's burst looks its key up once

    async def _enforced(self) -> bool:
        """Keys are required once any tenant exists (keys belong to tenants)."""
        return await self._redis.scard(keys.TENANTS_INDEX) > 0

    async def authenticate(self, key: str) -> Tenant | None:
        """The tenant owning ``key``, or None for an unknown or revoked key (or one whose tenant is gone)."""
        if not key.startswith(KEY_PREFIX) or len(key) > 128:
            return None
        return await self._authenticate(digest(key))

    async def _owner(self, wanted: str) -> Tenant | None:
        record = await self._redis.hgetall(keys.api_key_key(wanted))
        stored = record.get(b"digest", b"").decode()
        # The lookup already matched on the digest; comparing it again in constant time guards against a
        # record filed under the wrong name without giving a timing oracle.
        if not stored or not hmac.compare_digest(stored, wanted):
            return None
        return await self.tenant(record[b"tenant"].decode())

    async def tenant(self, name: str) -> Tenant | None:
        if not NAME_RE.match(name):
            return None
        raw = await self._redis.hgetall(keys.tenant_key(name))
        return Tenant.from_hash(name, raw) if raw else None

    async def tenants(self) -> list[Tenant]:
        names = sorted(n.decode() for n in await self._redis.smembers(keys.TENANTS_INDEX))
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.tenant_key(name))
        return [Tenant.from_hash(n, raw) for n, raw in zip(names, await pipe.execute(), strict=True) if raw]

    async def put_tenant(self, tenant: Tenant) -> tuple[Tenant, bool]:
        """Create ``tenant`` or update its settings; its cache salt and creation time survive updates.
        Returns the stored tenant and whether it was created."""
        key = keys.tenant_key(tenant.name)
        settings = {"models": json.dumps(tenant.models), "quota_period_s": tenant.quota_period_s,
                    "priority": tenant.priority or 0}
        settings.update({name: getattr(tenant, name) for name in _LIMITS if getattr(tenant, name)})
        unset = [name for name in _LIMITS if not getattr(tenant, name)]
        pipe = self._redis.pipeline(transaction=True)
        pipe.hsetnx(key, "cache_salt", secrets.token_hex(16))
        pipe.hsetnx(key, "created", repr(time.time()))
        pipe.hset(key, mapping=settings)
        if unset:
            pipe.hdel(key, *unset)
        pipe.sadd(keys.TENANTS_INDEX, tenant.name)
        pipe.hgetall(key)
        results = await pipe.execute()
        return Tenant.from_hash(tenant.name, results[-1]), bool(results[0])

    async def issue_key(self, tenant: str) -> tuple[ApiKey, str]:
        """A new key for ``tenant`` (which must exist): its record, and the key, which is not kept."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKey(id="key-" + secrets.token_hex(8), tenant=tenant, created=time.time())
        hashed = digest(key)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(keys.api_key_key(hashed), mapping={"id": record.id, "tenant": tenant, "digest": hashed,
                                                     "created": repr(record.created)})
        pipe.hset(keys.API_KEYS_INDEX, record.id, hashed)
        await pipe.execute()
        return record, key

    async def revoke_key(self, key_id: str) -> bool:
        hashed = await self._redis.hget(keys.API_KEYS_INDEX, key_id)
        if hashed is None:
            return False
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(keys.api_key_key(hashed.decode()))
        pipe.hdel(keys.API_KEYS_INDEX, key_id)
        await pipe.execute()
        return True

    async def keys(self, tenant: str | None = None) -> list[ApiKey]:
        index = await self._redis.hgetall(keys.API_KEYS_INDEX)
        pipe = self._redis.pipeline(transaction=False)
        for hashed in index.values():
            pipe.hgetall(keys.api_key_key(hashed.decode()))
        found = []
        for raw in await pipe.execute():
            if raw and (tenant is None or raw[b"tenant"].decode() == tenant):
                found.append(ApiKey(id=raw[b"id"].decode(), tenant=raw[b"tenant"].decode(),
                                    created=float(raw[b"created"])))
        return sorted(found, key=lambda k: k.created)


TENANTS = web.AppKey("tenants", TenantStore)
