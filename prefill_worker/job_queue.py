"""A model's job stream seen by one consumer: new jobs through the consumer group, jobs of dead peers
through ``XAUTOCLAIM``, poison and malformed jobs to the dead-letter stream.

A job stays pending (un-ACKed) until the caller says it is done, which for a prefill worker means the
decode side confirmed it holds the KV: a worker killed at any point before that leaves the job to be
reclaimed by a peer once it has been idle ``reclaim_idle_ms``. A draining worker need not wait for
that: ``hand_back`` makes its unfinished jobs reclaimable at once.

An ACKed entry is also deleted, so the stream's length is what is queued or in progress: the gateway
bounds it (``--max-queue-depth``). An ACK that fails (Redis restarting) is retried on the next fetch
rather than raised into the middle of an engine step, whose other outputs would then be lost.
"""

import logging
import time
from collections.abc import Callable

import redis

from shared import redis_keys as keys
from shared.protocol import Job, decode

log = logging.getLogger(__name__)

RECLAIM_EVERY_S = 1.0
# Idle time given to handed-back jobs: past any worker's reclaim_idle_ms, so the next XAUTOCLAIM of any
# consumer takes them.
HAND_BACK_IDLE_MS = 24 * 3600 * 1000


def replayable(job: Job) -> bool:
    """Would a peer re-running this job from scratch produce the same tokens (greedy, or seeded)? Only
    then may a job whose first tokens already reached the client be handed back: the gateway keeps the
    tokens it has and takes the rest from the peer, which must continue the same text."""
    return job.sampling.get("temperature", 1.0) == 0.0 or job.sampling.get("seed") is not None


class JobQueue:
    def __init__(self, client: redis.Redis, model: str, consumer: str, reclaim_idle_ms: int,
                 max_deliveries: int = keys.MAX_DELIVERIES, on_dead: Callable[[Job, str], None] | None = None):
        self.redis = client
        self.stream = keys.prefill_stream(model)
        self.dead = keys.dead_letter_stream(model)
        self.consumer = consumer
        self.reclaim_idle_ms = reclaim_idle_ms
        self.max_deliveries = max_deliveries
        self.on_dead = on_dead  # tells the job's client why it will get no answer
        self._last_reclaim = 0.0
        self._unacked: list[bytes] = []  # ACKs that failed; retried before the next read
        self.ensure_group()

    def ensure_group(self) -> None:
        try:  # id "0": jobs queued before the first worker started are still delivered
            self.redis.xgroup_create(self.stream, keys.PREFILL_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def fetch(self, count: int, block_ms: int) -> list[tuple[bytes, Job]]:
        """Up to ``count`` jobs: reclaimed ones first, then new ones (blocking up to block_ms if none)."""
        if self._unacked:
            self.ack()
        try:
            entries = self._read(count, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # Redis restarted empty: recreate the group and carry on
            return []
        jobs = []
        for entry_id, fields in entries:
            job = self._parse(entry_id, fields)
            if job is not None:
                jobs.append((entry_id, job))
        return jobs

    def _read(self, count: int, block_ms: int) -> list:
        entries = []
        now = time.monotonic()
        if now - self._last_reclaim >= RECLAIM_EVERY_S:
            self._last_reclaim = now
            entries += self._reclaim(count)
        if len(entries) < count:
            # BLOCK 0 would wait forever: a busy caller (block_ms=0) must not block at all
            block = block_ms if block_ms > 0 and not entries else None
            got = self.redis.xreadgroup(keys.PREFILL_GROUP, self.consumer, {self.stream: ">"},
                                        count=count - len(entries), block=block)
            for _stream, items in got or []:
                entries += items
        return entries

    def _reclaim(self, count: int) -> list:
        reply = self.redis.xautoclaim(self.stream, keys.PREFILL_GROUP, self.consumer, self.reclaim_idle_ms,
                                      start_id="0-0", count=count)
        claimed = [(eid, fields) for eid, fields in reply[1] if fields]
        kept = []
        for entry_id, fields in claimed:
            info = self.redis.xpending_range(self.stream, keys.PREFILL_GROUP, min=entry_id, max=entry_id, count=1)
            deliveries = info[0]["times_delivered"] if info else 1
            if deliveries > self.max_deliveries:
                reason = f"job failed on {deliveries - 1} workers"
                self.dead_letter(entry_id, fields, reason)
                job = self._parse(entry_id, fields)
                if job is not None and self.on_dead is not None:
                    self.on_dead(job, reason)
            else:
                log.info("reclaimed job %s (delivery %d)", entry_id, deliveries)
                kept.append((entry_id, fields))
        return kept

    def _parse(self, entry_id: bytes, fields: dict) -> Job | None:
        raw = fields.get(keys.JOB_FIELD.encode())
        try:
            if raw is None:
                raise ValueError(f"no {keys.JOB_FIELD!r} field")
            return decode(raw, Job)
        except ValueError as exc:
            self.dead_letter(entry_id, fields, f"malformed job: {exc}")
            return None

    def ack(self, *entry_ids: bytes) -> None:
        """ACK and delete ``entry_ids``, and any earlier ACK that failed (even while draining, when no
        fetch comes to retry them)."""
        entry_ids, self._unacked = (*self._unacked, *entry_ids), []
        if not entry_ids:
            return
        pipe = self.redis.pipeline()
        pipe.xack(self.stream, keys.PREFILL_GROUP, *entry_ids)
        pipe.xdel(self.stream, *entry_ids)
        try:
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("ACK of %d job(s) failed (%s); retrying later", len(entry_ids), exc)
            self._unacked.extend(entry_ids)

    def hand_back(self, entry_ids: list[bytes]) -> None:
        """Give our pending jobs up without finishing them: they stay pending (nothing is lost if we die
        here) but look idle for a day, so the next reclaim pass of any worker takes them. JUSTID keeps
        their delivery count, so a hand-back does not push a job toward the dead-letter stream."""
        if entry_ids:
            self.redis.xclaim(self.stream, keys.PREFILL_GROUP, self.consumer, 0, entry_ids,
                              idle=HAND_BACK_IDLE_MS, justid=True)

    def dead_letter(self, entry_id: bytes, fields: dict, reason: str) -> None:
        log.warning("job %s -> dead letter: %s", entry_id, reason)
        pipe = self.redis.pipeline()
        pipe.xadd(self.dead, {**fields, b"reason": reason.encode(), b"entry": entry_id}, maxlen=keys.STREAM_MAXLEN,
                  approximate=True)
        pipe.xack(self.stream, keys.PREFILL_GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.execute()
