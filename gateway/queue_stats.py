"""Per-model queue gauges for ``/metrics``, read from the Redis streams when scraped (cached briefly, so
several scrapers or a dashboard refresh cost one round of Redis reads).

Workers delete the entries they acknowledge, so ``XLEN`` is the backlog (the gateway's
``--max-queue-depth`` bounds it); the depth is still counted from the group, which stays right for
entries left by older workers that only acknowledged: what the consumer group has not delivered yet
plus what it delivered and nobody acknowledged (``XPENDING``). Redis 7 reports the undelivered count
as the group's ``lag``; on Redis 6.2 it is counted with ``XRANGE`` after the group's last-delivered id,
up to ``_COUNT_CAP`` (the gauge then reads "at least that many"). The oldest such entry's age comes
from its id, which is the Redis server's clock at ``XADD``, compared with the same clock's ``TIME``.

A model served under ``--scheduling-policy priority`` queues in one stream per priority band
(shared/wire/priority_bands.py); each band's counts as the shared stream does, and a model's gauges sum
them. Workers' private streams (prefix affinity, gateway/control/routing.py) count toward their model too.
Every worker registers in the shared stream's group as a consumer, so that list names them, dead ones not
yet adopted included; their entries are all queued or in progress (ACKed ones are deleted), so ``XLEN`` is
their depth and their first entry the oldest.
"""

import time
from dataclasses import dataclass

import redis
import redis.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.priority_bands import shared_streams

_COUNT_CAP = 1000
_NOW = "return redis.call('TIME')"  # [seconds, microseconds]


@dataclass
class QueueSnapshot:
    depth: int  # jobs not yet acknowledged: waiting for a worker, or being prefilled
    pending: int  # delivered to a worker and not acknowledged yet
    oldest_age_s: float  # of the oldest job in ``depth``; 0 when there is none
    dead_letters: int  # entries in the dead-letter stream


def _id_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


class QueueStats:
    """A prometheus collector over the last snapshot; ``refresh`` renews it from Redis."""

    def __init__(self, cache_s: float):
        self._cache_s = cache_s
        self._at = float("-inf")
        self.snapshot: dict[str, QueueSnapshot] = {}

    async def refresh(self, client: redis.asyncio.Redis, models: list[str]) -> None:
        if time.monotonic() - self._at < self._cache_s and set(models) == set(self.snapshot):
            return
        self.snapshot = {model: await self._read(client, model) for model in models}
        self._at = time.monotonic()

    async def _read(self, client: redis.asyncio.Redis, model: str) -> QueueSnapshot:
        streams = shared_streams(model)  # the shared stream, then the other priority bands'
        pipe = client.pipeline(transaction=False)
        # the clock of the node that holds the stream (its entry ids are that clock's), through a script: a
        # Redis Cluster refuses a keyless command (TIME) in a pipeline
        pipe.eval(_NOW, 1, streams[0])
        pipe.xlen(keys.dead_letter_stream(model))
        for stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            pipe.xpending(stream, keys.PREFILL_GROUP)
        (now_s, now_us), dead, *replies = await pipe.execute(raise_on_error=False)
        if isinstance(dead, Exception):
            raise dead
        oldest: list[int] = []
        undelivered = pending_count = 0
        for i, stream in enumerate(streams):
            length, groups, pending = replies[3 * i:3 * i + 3]
            if isinstance(length, Exception):
                raise length
            if i and not length:
                continue  # a band no job waits in (every band of a first come, first served model but 0)
            waiting, delivered = await self._read_shared(client, stream, length, groups, pending, oldest)
            undelivered += waiting
            pending_count += delivered
        private, private_pending = await self._read_private(client, model, oldest)
        undelivered += private - private_pending
        pending_count += private_pending
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        age = max(now_ms - min(oldest), 0) / 1000 if oldest and undelivered + pending_count else 0.0
        return QueueSnapshot(depth=undelivered + pending_count, pending=pending_count, oldest_age_s=age,
                             dead_letters=dead)

    @staticmethod
    async def _read_shared(client: redis.asyncio.Redis, stream: str, length: int, groups, pending,
                           oldest: list[int]) -> tuple[int, int]:
        """(undelivered, pending) of one stream the model's workers share, from its XLEN, XINFO GROUPS and
        XPENDING replies (an exception where the stream or group is missing); its oldest id goes to ``oldest``."""
        group = None
        if not isinstance(groups, Exception):
            group = next((g for g in groups if g["name"] == keys.PREFILL_GROUP.encode()), None)
        if group is None:  # no worker made the group yet: every entry is still waiting
            undelivered, pending_count = length, 0
            first = await client.xrange(stream, count=1)
        else:
            pending_count = 0 if isinstance(pending, Exception) else pending["pending"]
            if pending_count:
                oldest.append(_id_ms(pending["min"]))
            after = b"(" + group["last-delivered-id"]
            lag = group.get("lag")
            if lag is not None:
                undelivered = lag
                first = await client.xrange(stream, min=after, count=1) if lag else []
            else:
                entries = await client.xrange(stream, min=after, count=_COUNT_CAP)
                undelivered, first = len(entries), entries[:1]
        if first:
            oldest.append(_id_ms(first[0][0]))
        return undelivered, pending_count

    @staticmethod
    async def _read_private(client: redis.asyncio.Redis, model: str, oldest: list[int]) -> tuple[int, int]:
        """(entries, of which pending) over the model's private streams; their oldest ids go to ``oldest``."""
        try:
            consumers = await client.xinfo_consumers(keys.prefill_stream(model), keys.PREFILL_GROUP)
        except redis.ResponseError:
            return 0, 0  # no group yet: no worker, so no private stream either
        streams = [keys.prefill_worker_stream(model, c["name"].decode()) for c in consumers]
        pipe = client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
            pipe.xpending(stream, keys.PREFILL_GROUP)
            pipe.xrange(stream, count=1)
        replies = await pipe.execute(raise_on_error=False)
        total = pending_total = 0
        for length, pending, first in zip(replies[::3], replies[1::3], replies[2::3], strict=True):
            if isinstance(length, Exception) or not length:
                continue
            total += length
            pending_total += 0 if isinstance(pending, Exception) else pending["pending"]
            if not isinstance(first, Exception) and first:
                oldest.append(_id_ms(first[0][0]))
        return total, pending_total

    def collect(self):
        depth = GaugeMetricFamily("kvrelay_queue_depth", "Jobs queued for a model and not yet acknowledged "
                                  "by a prefill worker (waiting plus in progress)", labels=["model"])
        pending = GaugeMetricFamily("kvrelay_queue_pending", "Jobs delivered to a prefill worker and not yet "
                                    "acknowledged", labels=["model"])
        age = GaugeMetricFamily("kvrelay_queue_oldest_age_seconds", "Age of the oldest job not yet "
                                "acknowledged", labels=["model"])
        dead = CounterMetricFamily("kvrelay_dead_letter", "Jobs in the model's dead-letter stream",
                                   labels=["model"])
        for model, snap in sorted(self.snapshot.items()):
            depth.add_metric([model], snap.depth)
            pending.add_metric([model], snap.pending)
            age.add_metric([model], snap.oldest_age_s)
            dead.add_metric([model], snap.dead_letters)
        return [depth, pending, age, dead]
