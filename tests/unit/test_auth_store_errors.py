"""A tenant-store lookup that fails is a 503 the operator can explain: an outage goes to the Redis watch (logged
once, the gateway unready), any other Redis error (a NOPERM from an ACL that forgot the tenant keys) is
logged with the request."""

import asyncio
import logging

import pytest
import redis
import redis.asyncio
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvrelay.gateway.errors import APIError
from kvrelay.gateway.redis_watch import REDIS_WATCH, RedisWatch
from kvrelay.gateway.state import CONFIG
from kvrelay.gateway.tenancy import auth
from kvrelay.gateway.tenancy.tenants import TENANTS
from kvrelay.shared.config.gateway import GatewayConfig


class _FailingStore:
    def __init__(self, exc: redis.RedisError):
        self.exc = exc

    async def enforced(self) -> bool:
        raise self.exc

    async def authenticate(self, token: str):
        raise self.exc


def _request(exc: redis.RedisError, admin_key: str | None = None) -> web.Request:
    app = web.Application()
    app[CONFIG] = GatewayConfig(admin_key=admin_key)
    app[TENANTS] = _FailingStore(exc)
    app[REDIS_WATCH] = RedisWatch(redis.asyncio.Redis(), interval=1.0, outage_s=5.0)
    return make_mocked_request("POST", "/v1/completions", headers={"Authorization": "Bearer sk-x"}, app=app)


def _raised(coro) -> APIError:
    with pytest.raises(APIError) as info:
        asyncio.run(coro)
    return info.value


@pytest.mark.parametrize("admin_key", [None, "an-admin-key-of-24-chars"])
def test_a_redis_error_that_is_no_outage_is_logged_with_the_request(caplog, admin_key):
    request = _request(redis.ResponseError("NOPERM this user has no permissions to access one of the keys"), admin_key)
    with caplog.at_level(logging.WARNING, logger="kvrelay.gateway"):
        err = _raised(auth._tenant(request))
    assert err.status == 503 and err.code == "auth_unavailable"
    assert any("NOPERM" in r.getMessage() and "/v1/completions" in r.getMessage() for r in caplog.records)
    assert request.app[REDIS_WATCH].health.reason == "not checked yet"  # not taken for an outage


def test_an_outage_is_the_redis_watchs_to_log_once(caplog):
    request = _request(redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert _raised(auth._tenant(request)).status == 503
    assert "Connection refused" in request.app[REDIS_WATCH].health.reason
    lines = [r.getMessage() for r in caplog.records if "Connection refused" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("redis unreachable")
