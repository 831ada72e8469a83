"""Which gateways are gone, as their liveness keys say, found off the engine loop.

Every gateway SETs ``gateway_key(reply_addr)`` with EX=GATEWAY_TTL_S each GATEWAY_HEARTBEAT_S
(gateway/heartbeat.py). A thread of the worker checks the keys of the addresses its in-flight requests
reply to, one pipelined EXISTS round each CHECK_EVERY_S, and hands the loop every address missing for
CONFIRM_S through a queue (as the abort listener hands ids); the loop aborts that gateway's requests
(``Lifecycle.sweep``), which frees their KV instead of decoding for nobody until max_tokens.

CONFIRM_S: a Redis restart loses every key at once and live gateways need up to a beat to write theirs
again; a key missing over two rounds belongs to a gateway that stopped.
"""

import logging
import queue
import threading
import time

import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
CONFIRM_S = 2 * keys.GATEWAY_HEARTBEAT_S


class GatewayWatch:
    def __init__(self, client: redis.Redis, health: RedisHealth | None = None):
        self.redis = client
        self.health = health or RedisHealth(log)
        self._watched: frozenset[str] = frozenset()  # replaced whole by the loop, read by the thread
        self._gone: queue.Queue[str] = queue.Queue()
        self._missing_since: dict[str, float] = {}  # the thread's own

    def watch(self, addresses: set[str]) -> None:
        """The loop's in-flight reply addresses (an empty one belongs to no gateway)."""
        self._watched = frozenset(a for a in addresses if a)

    def alive(self, address: str) -> bool:
        """Whether the gateway at ``address`` beats now (one Redis round trip; a Redis error says yes:
        nobody is declared gone on a lost connection)."""
        try:
            return bool(self.redis.exists(keys.gateway_key(address)))
        except redis.RedisError:
            return True

    def take_holder(self, address: str) -> str | None:
        """A gateway whose process is known to have ended (its event connection closed): its liveness key's
        value (its host and pid), deleted, so that every other worker finds it gone within CONFIRM_S
        instead of waiting out its TTL. None: no key, or Redis cannot say."""
        try:
            value = self.redis.getdel(keys.gateway_key(address))
        except redis.RedisError:
            return None
        return None if value is None else value.decode()

    def holder(self, address: str) -> str | None:
        """Which gateway process beats on ``address`` now (None: none does); raises RedisError."""
        value = self.redis.get(keys.gateway_key(address))
        return None if value is None else value.decode()

    def take_gone(self) -> list[str]:
        gone = []
        while True:
            try:
                gone.append(self._gone.get_nowait())
            except queue.Empty:
                return gone

    def check(self) -> None:
        """One round: every watched address whose key has been missing for CONFIRM_S is reported, each
        round until it is watched no more (its requests still in their grace period wait for the next)."""
        addresses = sorted(self._watched)
        for addr in set(self._missing_since) - set(addresses):
            del self._missing_since[addr]
        if not addresses:
            return
        pipe = self.redis.pipeline(transaction=False)
        for addr in addresses:
            pipe.exists(keys.gateway_key(addr))
        alive = pipe.execute()
        now = time.monotonic()
        for addr, is_alive in zip(addresses, alive, strict=True):
            if is_alive:
                self._missing_since.pop(addr, None)
            elif now - self._missing_since.setdefault(addr, now) >= CONFIRM_S:
                self._gone.put(addr)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(CHECK_EVERY_S):
            try:
                self.check()
            except redis.RedisError as exc:  # cannot tell who is alive: nobody is declared gone
                if not self.health.absorb(exc):
                    log.warning("gateway watch lost Redis (%s); retrying", exc)
                self._missing_since.clear()
