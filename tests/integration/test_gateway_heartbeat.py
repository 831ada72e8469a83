"""The gateway's side of the liveness contract, against real Redis: its key (named by the reply address
its Jobs carry) exists with a TTL before the gateway serves, is renewed by further beats while it serves,
and is gone after a clean shutdown."""

import time

from kvrelay.gateway.state import DISPATCHER
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import GatewayServer, gateway_config

BOUND_S = 60.0  # a hang bound, not a speed claim: the gateway beats every GATEWAY_HEARTBEAT_S


def ttl_after_a_beat(r, key: str) -> int:
    """Takes the key's expiry away, then returns its TTL once a beat has given it one again (only a SET with
    EX does): a beat seen as it happens, however late a loaded box runs it, not guessed from a window."""
    assert r.persist(key), "the key is gone"
    deadline = time.monotonic() + BOUND_S
    while (ttl := r.ttl(key)) == -1:
        assert time.monotonic() < deadline, "no beat renewed the gateway's key"
        time.sleep(0.05)
    return ttl


def test_the_gateway_beats_while_it_serves_and_removes_its_key_on_shutdown(redis_url):
    r = sync_client(redis_url)
    server = GatewayServer(gateway_config(redis_url)).start()
    try:
        key = keys.gateway_key(server.app[DISPATCHER].address)
        assert 0 < r.ttl(key) <= keys.GATEWAY_TTL_S
        for _ in range(2):  # beat after beat, each with the TTL
            assert 0 < ttl_after_a_beat(r, key) <= keys.GATEWAY_TTL_S
    finally:
        server.stop()
    assert not r.exists(key)
