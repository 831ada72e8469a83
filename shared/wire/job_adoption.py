"""A job-stream consumer's adoption of its peers' private streams (job_queue.py): what the gateway routed to a
peer that will not read it is taken by the others.

A worker whose heartbeat is gone leaves its private stream to its peers: they find it through the shared
group's consumer list (every worker registers there as a consumer before it can be routed to) and adopt it,
reading what is undelivered and reclaiming what is pending, so nothing routed to a dead worker is lost. A
peer gone long enough has its empty stream and its consumer entry removed; the gateway only XADDs to a
private stream that exists, so a job can never land in one nobody reads.

A stalled worker (live by its heartbeat, which does not wait for steps, but in one engine step past
``--stalled-step-timeout-s``: shared/wire/step_stall.py) gets no new job, but what was routed to it before
would wait for its stall watch to end it (``--step-timeout``). Its peers take what it never read; what it
did read stays pending with it, to finish should it step again, or to be reclaimed as a dead worker's once it
is ended. None is taken twice: the private stream has one consumer group (PREFILL_GROUP), which its owner
reads as its consumer and a peer as its own, and an XREADGROUP ``>`` delivers the entries past the group's
last-delivered id and moves that id in the same command (Redis runs one at a time), so each entry goes to
exactly one consumer: never to two peers, nor to a peer and the owner once it wakes. A taken entry is pending
under the peer's name in the owner's stream, kept, ACKed and handed back as any adopted one.
"""

import logging
import time
from collections.abc import Callable

import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.step_stall import stalled_record, why_stalled

log = logging.getLogger(__name__)

# Peers' private streams are looked at less often: a dead peer's heartbeat takes HEARTBEAT_TTL_S to lapse, and a
# stalled one's step age is published once a heartbeat.
ADOPT_EVERY_S = keys.HEARTBEAT_INTERVAL_S
# A peer gone this long is no gateway's routing candidate (their registry caches are far shorter), so its
# emptied private stream and its consumer entry can go.
FORGET_AFTER_S = 60.0
# Deletes a private stream only while it is empty, atomically with any XADD the gateway may be making.
_DELETE_IF_EMPTY = "if redis.call('XLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end return 0"
# Removes consumer ARGV[2] from group ARGV[1] of stream KEYS[1] only while it holds no pending entry there (a
# DELCONSUMER drops those), so a pending job of a dead peer in a band stream is left for XAUTOCLAIM.
_DELETE_CONSUMER_IF_IDLE = """
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if type(pending) ~= 'table' or pending.err or #pending > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""

# take(peer's private stream, count, pending): up to ``count`` of its undelivered entries, after its pending ones
# when ``pending``, as the consumer's own (tagged, fields) entries
Take = Callable[[str, int, bool], list]


class PeerAdoption:
    def __init__(self, client: redis.Redis, model: str, consumer: str, stalled_step_timeout_s: float, take: Take,
                 bands: list[str] | None = None):
        """``stalled_step_timeout_s``: a live peer in one step for longer has its undelivered private jobs taken
        (0: never). ``bands``: the model's priority band streams besides the shared one, where a forgotten peer's
        consumer entry goes too."""
        self.redis = client
        self.model = model
        self.stream = keys.prefill_stream(model)
        self.consumer = consumer
        self.stalled_step_timeout_s = stalled_step_timeout_s
        self._take = take
        self.bands = bands or []
        self._gone_since: dict[str, float] = {}  # dead peer -> when we first saw its heartbeat missing
        self._stalled_peers: set[str] = set()  # as of the last adopt pass: said once per stall

    def adopt(self, count: int) -> list:
        """From peers' private streams: pending and undelivered jobs of those whose heartbeat is gone,
        undelivered ones of those stalled."""
        peers = [c for c in self.redis.xinfo_consumers(self.stream, keys.PREFILL_GROUP)
                 if c["name"].decode() != self.consumer]
        if not peers:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for peer in peers:
            pipe.get(keys.worker_key(peer["name"].decode()))
        records = pipe.execute()
        entries: list = []
        now = time.monotonic()
        stalled_now = set()
        for peer, record in zip(peers, records, strict=True):
            name = peer["name"].decode()
            stream = keys.prefill_worker_stream(self.model, name)
            if record is None:
                entries += self._take(stream, count - len(entries), True)
                if now - self._gone_since.setdefault(name, now) > FORGET_AFTER_S and peer["pending"] == 0:
                    self._forget(name, stream)
                continue
            self._gone_since.pop(name, None)
            if (worker := stalled_record(record, self.stalled_step_timeout_s)) is not None:
                stalled_now.add(name)
                if name not in self._stalled_peers:
                    log.warning("peer %r is stalled (%s): taking the jobs routed to it that it has not read", name,
                                why_stalled(worker.step_age_s, self.stalled_step_timeout_s))
                entries += self._take(stream, count - len(entries), False)
        self._stalled_peers = stalled_now
        if entries:
            log.info("adopted %d job(s) of dead or stalled peers", len(entries))
        return entries

    def _forget(self, name: str, stream: str) -> None:
        if self.redis.eval(_DELETE_IF_EMPTY, 1, stream) or not self.redis.exists(stream):
            # only once nothing of its is left anywhere; a pending shared entry would die with the consumer
            self.redis.xgroup_delconsumer(self.stream, keys.PREFILL_GROUP, name)
            for band in self.bands:
                self.redis.eval(_DELETE_CONSUMER_IF_IDLE, 1, band, keys.PREFILL_GROUP, name)
            self._gone_since.pop(name, None)
            log.info("forgot dead peer %s", name)
