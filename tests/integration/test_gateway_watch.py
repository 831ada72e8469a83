"""Workers learn that a gateway is gone from its liveness key in real Redis: a key missing over
CONFIRM_S is reported (each round until the address is no longer watched), a present one never, and a
Redis restart's empty moment is no death."""

from types import SimpleNamespace

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.worker import gateway_watch
from kvrelay.shared.worker.gateway_watch import GatewayWatch

ALIVE, DEAD = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


@pytest.fixture()
def clock(monkeypatch) -> list[float]:
    """The watch's clock, as the test moves it: however slow a loaded box runs the test, only the time the
    test adds passes for the watch (and the keys set here have no TTL to lapse meanwhile)."""
    now = [0.0]
    monkeypatch.setattr(gateway_watch, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.delete(keys.gateway_key(ALIVE), keys.gateway_key(DEAD))
    yield client
    client.delete(keys.gateway_key(ALIVE), keys.gateway_key(DEAD))


def test_a_lapsed_key_is_reported_after_confirmation_and_a_live_one_never(r, clock):
    watch = GatewayWatch(r)
    watch.watch({ALIVE, DEAD, ""})
    r.set(keys.gateway_key(ALIVE), "gw")
    watch.check()
    assert watch.take_gone() == []  # missing once is not gone yet
    clock[0] += gateway_watch.CONFIRM_S / 2
    watch.check()
    assert watch.take_gone() == []  # nor missing for less than CONFIRM_S
    clock[0] += gateway_watch.CONFIRM_S / 2
    watch.check()
    assert watch.take_gone() == [DEAD]
    watch.check()
    assert watch.take_gone() == [DEAD]  # again, for requests that were still in their grace period
    watch.watch({ALIVE})
    watch.check()
    assert watch.take_gone() == []


def test_a_key_back_within_the_confirmation_is_no_death(r, clock):
    watch = GatewayWatch(r)
    watch.watch({DEAD})
    watch.check()  # Redis restarted empty: the gateway has not beaten again yet
    r.set(keys.gateway_key(DEAD), "gw")
    clock[0] += gateway_watch.CONFIRM_S
    watch.check()
    assert watch.take_gone() == []
    r.delete(keys.gateway_key(DEAD))  # it stops later: confirmed afresh, not counted from the first miss
    watch.check()
    assert watch.take_gone() == []
