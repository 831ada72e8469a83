"""The gateway's side of the liveness contract, against real Redis: its key (named by the reply address
its Jobs carry) exists with a TTL before the gateway serves, is kept alive past that TTL, and is gone
after a clean shutdown."""

import time

from kvrelay.gateway.state import DISPATCHER
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import GatewayServer, gateway_config


def test_the_gateway_beats_while_it_serves_and_removes_its_key_on_shutdown(redis_url):
    r = sync_client(redis_url)
    server = GatewayServer(gateway_config(redis_url)).start()
    try:
        key = keys.gateway_key(server.app[DISPATCHER].address)
        assert 0 < r.ttl(key) <= keys.GATEWAY_TTL_S
        time.sleep(keys.GATEWAY_TTL_S + 1)  # past the first beat's TTL: only further beats keep it
        assert r.exists(key)
    finally:
        server.stop()
    assert not r.exists(key)
