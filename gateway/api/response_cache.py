"""Opt-in response cache (``--response-cache-ttl``): a deterministic request asked again within the TTL
gets the stored response body back, byte for byte (same ``id`` and ``created`` too), without a worker.

Only what is deterministic and answered in one body is cached: non-streamed requests with temperature
0 or a fixed seed. The key hashes the tenant, the endpoint, the model *and its path* (a new version of
a model never serves the old one's answers) and the request body after validation, with defaults
filled in and key order fixed, so ``{"temperature": 0}`` and ``{"temperature": 0.0, "top_p": 1}`` are
one entry. The tenant is also in the Redis key name: an entry is never served across tenants, and one
tenant's entries can be dropped with one SCAN pattern.

The cache is best effort: a Redis error is a miss, never a failed request.
"""

import hashlib
import json
import logging

import redis
import redis.asyncio
from aiohttp import web
from pydantic import BaseModel

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.protocol import ModelInfo
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger("kvrelay.gateway")

# Fields that cannot change the answer; leaving them out lets more requests share an entry.
_IGNORED = {"user", "priority", "stream_options"}


def cacheable(body: BaseModel) -> bool:
    return not getattr(body, "stream", False) and (body.temperature == 0 or body.seed is not None)


def request_key(tenant: str, endpoint: str, model: ModelInfo, body: BaseModel) -> str:
    fields = body.model_dump(mode="json", exclude=_IGNORED)
    fields["model"] = model.name  # an omitted model and the name it resolved to are one request
    normalized = json.dumps({"tenant": tenant, "endpoint": endpoint, "model_path": model.path, "body": fields},
                            sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return keys.response_cache_key(tenant, hashlib.sha256(normalized.encode()).hexdigest())


class ResponseCache:
    def __init__(self, client: redis.asyncio.Redis, ttl_s: float, max_bytes: int,
                 health: RedisHealth | None = None):
        """``health``: where an outage is reported (logged once), instead of a warning per request."""
        self._redis = client
        self._health = health or RedisHealth(log)
        self.ttl_ms = int(ttl_s * 1000)
        self.max_bytes = max_bytes

    @property
    def enabled(self) -> bool:
        return self.ttl_ms > 0

    async def get(self, key: str) -> bytes | None:
        try:
            return await self._redis.get(key)
        except redis.RedisError as exc:
            if not self._health.absorb(exc):
                log.warning("response cache read failed: %s", exc)
            return None

    async def put(self, key: str, body: bytes) -> None:
        if len(body) > self.max_bytes:
            return
        try:
            await self._redis.set(key, body, px=self.ttl_ms)
        except redis.RedisError as exc:
            if not self._health.absorb(exc):
                log.warning("response cache write failed: %s", exc)


RESPONSE_CACHE = web.AppKey("response_cache", ResponseCache)
