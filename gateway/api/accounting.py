"""A generation request's accounting, wrapped around its ``Generation``:

    async with Meter(request, prepared, body, "completions") as meter:
        if meter.cached is not None:
            return meter.cached
        async with Generation(request, prepared) as gen:
            meter.generation = gen
            ...
            return await meter.respond(web.json_response(...))

Entering: the response cache is asked first (deterministic requests, cache on), then the tenant's
limits (``tenancy/limits.py``; 429 past them). A hit is charged as one request and no tokens; anything else
reserves its prompt plus ``max_tokens`` per choice. Leaving, however it leaves (success, error, client
gone): unused tokens go back to the limits, usage is recorded per minute (``tenancy/usage.py``), metrics move.
A request refused before it reached the queue used nothing and is not recorded as usage.
"""

import asyncio
import logging

import redis
from aiohttp import web
from pydantic import BaseModel

from kvrelay.gateway.api.generation import Generation
from kvrelay.gateway.api.prompts import Prepared
from kvrelay.gateway.api.response_cache import RESPONSE_CACHE, cacheable, request_key
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.redis_watch import redis_failed
from kvrelay.gateway.state import METRICS, spawn
from kvrelay.gateway.tenancy.auth import TENANT
from kvrelay.gateway.tenancy.limits import LIMITER, LimitExceeded, Reservation
from kvrelay.gateway.tenancy.usage import USAGE

log = logging.getLogger("kvrelay.gateway")

CACHE_HEADER = "X-Kvrelay-Cache"  # "hit" or "miss", on cacheable requests while the cache is on


class Meter:
    def __init__(self, request: web.Request, prepared: Prepared, body: BaseModel, endpoint: str):
        self.app = request.app
        self.tenant = request[TENANT]
        self.prepared = prepared
        self.model = prepared.model_name
        self.cached: web.Response | None = None
        self.generation: Generation | None = None
        self._reservation: Reservation | None = None
        cache = self.app[RESPONSE_CACHE]
        self._cache_key = (request_key(self.tenant.name, endpoint, prepared.model, body)
                           if cache.enabled and cacheable(body) else None)

    @property
    def reserved_tokens(self) -> int:
        """What the request may use at most: every prompt, plus max_tokens for each of its choices."""
        prompts, params = self.prepared.prompts, self.prepared.params
        return sum(len(p) for p in prompts) + len(prompts) * params.n * params.max_tokens

    async def __aenter__(self) -> "Meter":
        metrics = self.app[METRICS]
        hit = await self.app[RESPONSE_CACHE].get(self._cache_key) if self._cache_key else None
        try:
            self._reservation = await self.app[LIMITER].admit(self.tenant, 0 if hit is not None else self.reserved_tokens)
        except LimitExceeded as exc:
            metrics.rate_limited.labels(metrics.tenant(self.tenant.name), exc.reason).inc()
            raise exc.api_error() from None
        except redis.RedisError as exc:
            # Fail closed: without Redis the limits cannot hold, and the queue is down as well anyway.
            if not redis_failed(self.app, exc):
                log.warning("rate limiter unavailable: %s", exc)
            raise APIError(503, "the rate limiter is unavailable; retry later", code="limiter_unavailable",
                           headers={"Retry-After": "1"}) from None
        if self._cache_key is not None:
            (metrics.cache_hits if hit is not None else metrics.cache_misses).labels(
                metrics.tenant(self.tenant.name)).inc()
        if hit is not None:
            self.cached = web.Response(body=hit, content_type="application/json", charset="utf-8",
                                       headers={CACHE_HEADER: "hit"})
        metrics.in_flight.labels(self.model).inc()
        return self

    async def respond(self, response: web.Response) -> web.Response:
        """The finished non-streamed response, stored for later hits when it is cacheable and complete."""
        gen = self.generation
        if self._cache_key is not None and gen is not None:
            response.headers[CACHE_HEADER] = "miss"
            if all(c.finish_reason in ("stop", "length") for c in gen.choices):
                await self.app[RESPONSE_CACHE].put(self._cache_key, response.body)
        return response

    async def __aexit__(self, *exc_info: object) -> None:
        self.app[METRICS].in_flight.labels(self.model).dec()
        # Detached and shielded: a handler cancelled by a disconnecting client still settles its tokens.
        await asyncio.shield(spawn(self.app, self._settle()))

    async def _settle(self) -> None:
        gen, tenant, metrics = self.generation, self.tenant.name, self.app[METRICS]
        prompt = gen.num_prompt_tokens if gen is not None else 0
        completion = gen.num_completion_tokens if gen is not None else 0
        try:
            if self._reservation is not None:
                await self.app[LIMITER].settle(self._reservation, prompt + completion)
            if gen is not None or self.cached is not None:
                await self.app[USAGE].record(tenant, self.model, prompt, completion, cache_hit=self.cached is not None)
        except redis.RedisError as exc:
            if not redis_failed(self.app, exc):
                log.warning("could not settle usage of tenant %s: %s", tenant, exc)
        if prompt:
            metrics.tenant_tokens.labels(metrics.tenant(tenant), self.model, "prompt").inc(prompt)
        if completion:
            metrics.tenant_tokens.labels(metrics.tenant(tenant), self.model, "completion").inc(completion)
