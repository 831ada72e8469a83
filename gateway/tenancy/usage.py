"""What each tenant used, per model and minute, in Redis: the numbers behind ``GET /admin/usage``.

Every finished request adds to the hash of its (tenant, model, unix minute): requests, prompt tokens,
completion tokens (as reported in the response's ``usage``) and response-cache hits. Buckets expire
after ``retention_s``, so a range query can reach back that far and Redis does not grow without bound.
A cache hit counts as a request and a cache hit, not as tokens: no worker computed anything for it.
"""

import time
from dataclasses import dataclass

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.coalesced import Coalesced
from kvrelay.shared.wire import redis_keys as keys

FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cache_hits")
_PIPELINE_CHUNK = 1000  # HGETALLs per round trip when a query spans many minutes


@dataclass
class Usage:
    tenant: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0

    def as_dict(self) -> dict:
        return {"tenant": self.tenant, "model": self.model, "requests": self.requests,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "cache_hits": self.cache_hits}


class UsageLedger:
    def __init__(self, client: redis.asyncio.Redis, retention_s: int):
        self._redis = client
        self.retention_s = retention_s
        # (tenant, model, minute) -> field -> what finished requests added since the last write: a burst of
        # finished requests goes out in one pipeline, summed per bucket, instead of one pipeline each
        self._pending: dict[tuple[str, str, int], dict[str, int]] = {}
        self._write = Coalesced(self._write_pending)

    async def record(self, tenant: str, model: str, prompt_tokens: int, completion_tokens: int,
                     cache_hit: bool = False, now: float | None = None) -> None:
        """Returns once Redis holds this request's counts (with every other request's queued beside them)."""
        minute = int((time.time() if now is None else now) // 60)
        bucket = self._pending.setdefault((tenant, model, minute), dict.fromkeys(FIELDS, 0))
        bucket["requests"] += 1
        bucket["prompt_tokens"] += prompt_tokens
        bucket["completion_tokens"] += completion_tokens
        bucket["cache_hits"] += cache_hit
        await self._write()

    async def _write_pending(self) -> None:
        pending, self._pending = self._pending, {}
        pipe = self._redis.pipeline(transaction=False)
        for (tenant, model, minute), counts in pending.items():
            key = keys.usage_key(tenant, model, minute)
            for field_name, n in counts.items():
                if n:
                    pipe.hincrby(key, field_name, n)
            pipe.expire(key, self.retention_s + 60)
        for tenant in {t for t, _, _ in pending}:
            pipe.sadd(keys.USAGE_TENANTS, tenant)
        for tenant, model in {(t, m) for t, m, _ in pending}:
            pipe.sadd(keys.usage_models_key(tenant), model)
        await pipe.execute()

    async def query(self, tenant: str | None, model: str | None, start: float, end: float) -> list[Usage]:
        """Totals per (tenant, model) over the minutes that overlap [start, end], unix seconds."""
        tenants = [tenant] if tenant else sorted(t.decode() for t in await self._redis.smembers(keys.USAGE_TENANTS))
        pairs = []
        for t in tenants:
            models = [model] if model else sorted(m.decode() for m in await self._redis.smembers(keys.usage_models_key(t)))
            pairs += [(t, m) for m in models]
        minutes = range(int(start // 60), int(end // 60) + 1)
        totals = []
        for t, m in pairs:
            usage = Usage(t, m)
            names = [keys.usage_key(t, m, minute) for minute in minutes]
            for i in range(0, len(names), _PIPELINE_CHUNK):
                pipe = self._redis.pipeline(transaction=False)
                for name in names[i : i + _PIPELINE_CHUNK]:
                    pipe.hgetall(name)
                for bucket in await pipe.execute():
                    for field in FIELDS:
                        setattr(usage, field, getattr(usage, field) + int(bucket.get(field.encode(), 0)))
            if usage.requests or (tenant and model):
                totals.append(usage)
        return totals


USAGE = web.AppKey("usage", UsageLedger)
