"""RedisHealth: many threads reporting one outage give one line when it starts and one when it ends;
errors that are no outage are left to the caller."""

import logging
import threading

import redis

from kvrelay.shared.wire.redis_health import RedisHealth

log = logging.getLogger("test.redis_health")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_one_line_per_change_across_threads(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    health = RedisHealth(log)
    assert not health.reachable and health.down_since is None  # not tried yet: not reachable, not down
    assert health.ok() is False and health.reachable and _lines(caplog) == []  # the first success says nothing
    start = threading.Barrier(16)

    def report() -> None:
        start.wait()
        for _ in range(100):
            assert health.absorb(redis.ConnectionError("Connection refused"))

    threads = [threading.Thread(target=report) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _lines(caplog) == ["redis unreachable: Connection refused"]
    assert not health.reachable and health.down_since is not None and health.down_for() >= 0
    assert health.ok() is True and health.ok() is False  # only the first success ends the outage
    lines = _lines(caplog)
    assert len(lines) == 2 and lines[1].startswith("redis reachable again after ")
    assert health.reachable and health.down_for() == 0.0
    # a command begun before the recovery that fails just after it is no new outage
    assert health.absorb(redis.ConnectionError("Connection closed by server.")) and health.reachable
    assert len(_lines(caplog)) == 2


def test_other_errors_are_no_outage(caplog):
    health = RedisHealth(log)
    health.ok()
    assert health.absorb(redis.ResponseError("NOPERM this user has no permissions")) is False
    assert health.absorb(redis.TimeoutError("Timeout reading from socket")) is True
    assert not health.reachable and health.reason == "Timeout reading from socket"
