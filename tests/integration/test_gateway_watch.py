"""Workers learn that a gateway is gone from its liveness key in real Redis: a key missing over
CONFIRM_S is reported (each round until the address is no longer watched), a present one never, and a
Redis restart's empty moment is no death."""

import time

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.worker import gateway_watch
from kvrelay.shared.worker.gateway_watch import GatewayWatch

ALIVE, DEAD = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.delete(keys.gateway_key(ALIVE), keys.gateway_key(DEAD))
    yield client
    client.delete(keys.gateway_key(ALIVE), keys.gateway_key(DEAD))


def test_a_lapsed_key_is_reported_after_confirmation_and_a_live_one_never(r):
    watch = GatewayWatch(r)
    watch.watch({ALIVE, DEAD, ""})
    r.set(keys.gateway_key(ALIVE), "gw", ex=keys.GATEWAY_TTL_S)
    watch.check()
    assert watch.take_gone() == []  # missing once is not gone yet
    time.sleep(gateway_watch.CONFIRM_S)
    watch.check()
    assert watch.take_gone() == [DEAD]
    watch.check()
    assert watch.take_gone() == [DEAD]  # again, for requests that were still in their grace period
    watch.watch({ALIVE})
    watch.check()
    assert watch.take_gone() == []


def test_a_key_back_within_the_confirmation_is_no_death(r):
    watch = GatewayWatch(r)
    watch.watch({DEAD})
    watch.check()  # Redis restarted empty: the gateway has not beaten again yet
    r.set(keys.gateway_key(DEAD), "gw", ex=keys.GATEWAY_TTL_S)
    time.sleep(gateway_watch.CONFIRM_S)
    watch.check()
    assert watch.take_gone() == []
