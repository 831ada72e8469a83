"""Per-tenant rate limits and token quotas, enforced in Redis so they hold across every gateway replica.

One Lua script checks all of a tenant's limits and, only if every one has room, charges them — atomic,
so two replicas admitting at the same instant cannot both take the last slot, and a request refused by
one limit consumes none of the others. Time comes from Redis (``TIME``), not from each gateway's clock.

- **RPM** counts requests, **TPM** counts tokens, each over a sliding 60 s window kept as one counter per
  second (a hash of at most 60 fields): exact to the second, with no burst at a window boundary, and the
  ``Retry-After`` is when enough of the oldest seconds age out for this request to fit.
- **Tokens are reserved up front**: prompt tokens plus ``max_tokens`` for every choice, as OpenAI counts
  them. When the request ends, what was reserved but not generated is handed back (``settle``), into the
  same second's counter (and the same quota period) it was charged to. So a limit is never exceeded,
  even by requests still running, and a request that stops early costs only what it used.
- **Quota** is tokens per fixed period (``quota_period_s``; periods start at multiples of it since the
  Unix epoch, so a day's quota resets at 00:00 UTC). ``Retry-After`` is the time to the next period.

A request that could never fit (more tokens than the whole limit) is refused without ``Retry-After``:
waiting would not help; a smaller ``max_tokens`` would.
"""

from dataclasses import dataclass

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.errors import APIError
from kvrelay.gateway.tenancy.tenants import Tenant
from kvrelay.shared.wire import redis_keys as keys

WINDOW_S = 60

# KEYS: rpm hash, tpm hash, quota hash. ARGV: rpm, tpm, quota limits (0: none), quota period, tokens, window.
# Returns {1, second, period index} when admitted, {0, limit name, retry-after seconds or -1 for never}.
_ADMIT = """
redis.replicate_commands()  -- Redis < 7: replicate the writes, not the script, since TIME differs per replica
local now = tonumber(redis.call('TIME')[1])
local window = tonumber(ARGV[6])
local tokens = tonumber(ARGV[5])

local function load(key)
  local raw = redis.call('HGETALL', key)
  local used, buckets, stale = 0, {}, {}
  for i = 1, #raw, 2 do
    local second, n = tonumber(raw[i]), tonumber(raw[i + 1])
    if second <= now - window then
      stale[#stale + 1] = raw[i]
    else
      used = used + n
      buckets[#buckets + 1] = {second, n}
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  return used, buckets
end

local function wait_for(buckets, used, cost, limit)
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  for _, bucket in ipairs(buckets) do
    used = used - bucket[2]
    if used + cost <= limit then return bucket[1] + window - now end
  end
  return window
end

local windows = {{KEYS[1], tonumber(ARGV[1]), 1, 'rpm'}, {KEYS[2], tonumber(ARGV[2]), tokens, 'tpm'}}
for _, w in ipairs(windows) do
  local key, limit, cost, name = w[1], w[2], w[3], w[4]
  if limit > 0 then
    if cost > limit then return {0, name, -1} end
    local used, buckets = load(key)
    if used + cost > limit then return {0, name, wait_for(buckets, used, cost, limit)} end
  end
end

local quota, period = tonumber(ARGV[3]), tonumber(ARGV[4])
local index = math.floor(now / period)
if quota > 0 then
  if tokens > quota then return {0, 'quota', -1} end
  local fields = redis.call('HKEYS', KEYS[3])
  for _, f in ipairs(fields) do
    if tonumber(f) ~= index then redis.call('HDEL', KEYS[3], f) end
  end
  local used = tonumber(redis.call('HGET', KEYS[3], index) or '0')
  if used + tokens > quota then return {0, 'quota', (index + 1) * period - now} end
end

if tonumber(ARGV[1]) > 0 then
  redis.call('HINCRBY', KEYS[1], now, 1)
  redis.call('EXPIRE', KEYS[1], window + 1)
end
if tonumber(ARGV[2]) > 0 and tokens > 0 then
  redis.call('HINCRBY', KEYS[2], now, tokens)
  redis.call('EXPIRE', KEYS[2], window + 1)
end
if quota > 0 and tokens > 0 then
  redis.call('HINCRBY', KEYS[3], index, tokens)
  redis.call('EXPIRE', KEYS[3], period + window)
end
return {1, now, index}
"""

# KEYS: tpm hash, quota hash. ARGV: second, period index, tokens back to tpm, tokens back to quota.
# A counter that already aged out is left alone: handing tokens back to it would resurrect it.
_SETTLE = """
local fields = {ARGV[1], ARGV[2]}
for i = 1, 2 do
  local back = tonumber(ARGV[i + 2])
  if back > 0 and redis.call('HEXISTS', KEYS[i], fields[i]) == 1 then
    if redis.call('HINCRBY', KEYS[i], fields[i], -back) <= 0 then redis.call('HDEL', KEYS[i], fields[i]) end
  end
end
return 1
"""

_MESSAGES = {
    "rpm": ("requests per minute (RPM)", "requests", "rate_limit_exceeded"),
    "tpm": ("tokens per minute (TPM)", "tokens", "rate_limit_exceeded"),
    "quota": ("token quota", "tokens", "insufficient_quota"),
}


class LimitExceeded(Exception):
    def __init__(self, tenant: Tenant, reason: str, retry_after: int, requested: int):
        super().__init__(reason)
        self.tenant = tenant
        self.reason = reason  # "rpm", "tpm" or "quota"
        self.retry_after = retry_after  # seconds; -1: the request can never fit
        self.requested = requested

    def api_error(self) -> APIError:
        what, unit, code = _MESSAGES[self.reason]
        limit = {"rpm": self.tenant.rpm, "tpm": self.tenant.tpm, "quota": self.tenant.quota_tokens}[self.reason]
        requested = 1 if self.reason == "rpm" else self.requested
        if self.retry_after < 0:
            return APIError(429, f"Request too large for {what}: limit {limit}, requested {requested} {unit}. "
                                 "Reduce the prompt or max_tokens.", code="request_too_large")
        period = f" per {self.tenant.quota_period_s}s" if self.reason == "quota" else ""
        return APIError(429, f"Rate limit reached for {what}: limit {limit}{period}, requested {requested} "
                             f"{unit}. Please try again in {self.retry_after}s.", code=code,
                        headers={"Retry-After": str(self.retry_after)})


@dataclass
class Reservation:
    tenant: Tenant
    tokens: int  # charged to TPM and quota at admission
    second: int  # Redis time of admission: the TPM counter the tokens went to
    period: int  # the quota period they went to


class RateLimiter:
    def __init__(self, client: redis.asyncio.Redis):
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)

    @staticmethod
    def _keys(tenant: Tenant) -> list[str]:
        return [keys.limit_key(tenant.name, kind) for kind in ("rpm", "tpm", "quota")]

    async def admit(self, tenant: Tenant, tokens: int) -> Reservation:
        """Charge one request and ``tokens`` to ``tenant``'s limits, or raise LimitExceeded."""
        if not tenant.limited:
            return Reservation(tenant, tokens, 0, 0)
        args = [tenant.rpm or 0, tenant.tpm or 0, tenant.quota_tokens or 0, tenant.quota_period_s, tokens, WINDOW_S]
        result = await self._admit(keys=self._keys(tenant), args=args)
        if result[0] != 1:
            reason = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
            raise LimitExceeded(tenant, reason, max(int(result[2]), 1) if int(result[2]) >= 0 else -1, tokens)
        return Reservation(tenant, tokens, int(result[1]), int(result[2]))

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Hand back what was reserved and not used."""
        tenant = reservation.tenant
        back = max(reservation.tokens - used_tokens, 0)
        if back == 0 or not (tenant.tpm or tenant.quota_tokens):
            return
        _, tpm_key, quota_key = self._keys(tenant)
        args = [reservation.second, reservation.period, back if tenant.tpm else 0, back if tenant.quota_tokens else 0]
        await self._settle(keys=[tpm_key, quota_key], args=args)


LIMITER = web.AppKey("limiter", RateLimiter)
