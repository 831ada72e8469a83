"""A model's job streams seen by one consumer: new jobs through the consumer group, jobs of dead peers
through ``XAUTOCLAIM``, poison and malformed jobs, and those of a gateway more than one wire protocol version
apart, to the dead-letter stream, their clients told why.

Two streams feed a worker: the model's shared stream, which any free worker takes from, and its private
stream, where the gateway routes jobs whose prompt prefix this worker likely has cached (prefix
affinity, gateway/control/routing.py). Private jobs are read first. The private stream of a dead peer, and
what a stalled one has not read of its, the others adopt (job_adoption.py).

A model served under ``--scheduling-policy priority`` has a stream per priority band (priority_bands.py),
the shared stream being band 0. They are read best band first: the better bands, then the private stream
(which holds band-0 jobs only), then band 0, then the worse bands. The other bands are shared streams like
band 0 in every other respect: a dead worker's pending jobs in any of them are reclaimed by whoever reads
next, and a hand-back leaves them there for the next reclaim.

A job stays pending (un-ACKed) until the caller says it is done, which for a prefill worker means the
decode side confirmed it holds the KV: a worker killed at any point before that leaves the job to be
reclaimed by a peer once it has been idle ``reclaim_idle_ms``. A draining worker need not wait for
that: ``hand_back`` makes its unfinished jobs reclaimable at once, and moves private ones (and its
private stream's undelivered ones) to the shared stream.

Entry ids handed to the caller are the stream's ids for shared-stream entries and ``stream@id`` for the
others, so ``ack`` and ``hand_back`` know where an entry lives without any state of ours.

An ACKed entry is also deleted, so the stream's length is what is queued or in progress: the gateway
bounds it (``--max-queue-depth``). An ACK that fails (Redis restarting) is retried on the next fetch
rather than raised into the middle of an engine step, whose other outputs would then be lost.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import redis

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, peek_strings
from kvrelay.shared.wire.job_adoption import ADOPT_EVERY_S, PeerAdoption
from kvrelay.shared.wire.priority_bands import BANDS
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.redis_health import RedisHealth
from kvrelay.shared.wire.version import version_refusal

log = logging.getLogger(__name__)

RECLAIM_EVERY_S = 1.0
# Deliveries before a hand-back moved the entry to the shared stream, where its count starts again.
PRIOR_FIELD = b"deliveries"
_SEP = b"@"
# XREADGROUP of KEYS in turn (no BLOCK: allowed in a script) until ARGV[3] entries: exactly ``count`` from
# all the streams, where one XREADGROUP over them could deliver that many from each (its COUNT is per stream).
_READ_IN_ORDER = """
local want, out = tonumber(ARGV[3]), {}
for _, key in ipairs(KEYS) do
  if want <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want, 'STREAMS', key, '>')
  if got then
    want = want - #got[1][2]
    out[#out + 1] = got[1]
  end
end
return out
"""
# Gateways refused as too far apart that are remembered (so warned about once): a restarted gateway comes back
# under a new reply address, and the oldest of a few hundred is long gone by the time it is forgotten.
FAR_GATEWAYS_KEPT = 256
# Idle time given to handed-back jobs: past any worker's reclaim_idle_ms, so the next XAUTOCLAIM of any
# consumer takes them.
HAND_BACK_IDLE_MS = 24 * 3600 * 1000


def replayable(job: Job) -> bool:
    """Would a peer re-running this job from scratch produce the same tokens (greedy, or seeded)? Only
    then may a job whose first tokens already reached the client be handed back: the gateway keeps the
    tokens it has and takes the rest from the peer, which must continue the same text."""
    return job.sampling.temperature == 0.0 or job.sampling.seed is not None


def _lost_group(exc: redis.ResponseError) -> bool:
    """The stream or its group is gone: Redis restarted empty (XINFO says "no such key" there)."""
    return "NOGROUP" in str(exc) or "no such key" in str(exc)


class JobQueue:
    def __init__(self, client: redis.Redis, model: str, consumer: str, reclaim_idle_ms: int,
                 max_deliveries: int = keys.MAX_DELIVERIES,
                 on_dead: Callable[[str, str, str], None] | None = None,
                 health: RedisHealth | None = None, stalled_step_timeout_s: float = 0.0, priority_bands: bool = False):
        """``stalled_step_timeout_s``: a live peer in one step for longer has its undelivered private jobs taken
        (0: never). ``priority_bands``: the model is served under --scheduling-policy priority, so its band
        streams are read as well, best band first."""
        self.redis = client
        self.health = health or RedisHealth(log)  # where a failed ACK reports an outage
        self.model = model
        self.stream = keys.prefill_stream(model)
        self.private = keys.prefill_worker_stream(model, consumer)
        self.dead = keys.dead_letter_stream(model)
        # the band streams other than band 0 (the shared stream); none for a first come, first served model
        better = [keys.prefill_band_stream(model, b) for b in BANDS if b < 0] if priority_bands else []
        worse = [keys.prefill_band_stream(model, b) for b in BANDS if b > 0] if priority_bands else []
        self.bands = better + worse
        # a first come, first served model's band streams: empty unless its policy was priority before a swap
        # left jobs there, which no gateway adds to any more and which are older than anything in the shared
        # stream, so they are taken as soon as seen (_stranded), not left to their deadline
        self.stranded = [] if priority_bands else [keys.prefill_band_stream(model, b) for b in BANDS if b]
        # what a read takes from, in turn: private jobs are band 0's, so they go after the better bands
        self.order = [*better, self.private, self.stream, *worse]
        self.consumer = consumer
        self.reclaim_idle_ms = reclaim_idle_ms
        self.max_deliveries = max_deliveries
        self.adoption = PeerAdoption(client, model, consumer, stalled_step_timeout_s, self._take_from_peer,
                                     self.bands)
        # on_dead(request id, reply address, why): tells the job's client why it will get no answer
        self.on_dead = on_dead
        self._last_reclaim = 0.0
        self._last_adopt = 0.0
        self._unacked: list[bytes] = []  # ACKs deferred or failed; sent by the next ack() or read
        # entries a blocking read delivered beyond ``count`` (both streams answered at once); served first
        self._surplus: list[tuple[bytes, dict]] = []
        # reply addresses of gateways refused as too many versions apart, least recently refused first
        self._far_gateways: OrderedDict[str, None] = OrderedDict()
        self.ensure_group()

    def ensure_group(self) -> None:
        """Our streams, their consumer group and our consumer in it, whichever are missing (XGROUP CREATE
        MKSTREAM): at start, and again when Redis restarted without them."""
        for stream in (self.stream, self.private, *self.bands):
            self._join(stream, mkstream=True)
        # listed in the shared group before any gateway can route to us: how peers find our private stream
        self.redis.xgroup_createconsumer(self.stream, keys.PREFILL_GROUP, self.consumer)

    def fetch(self, count: int, block_ms: int) -> list[tuple[bytes, Job]]:
        """Up to ``count`` jobs: reclaimed and adopted ones first, then new ones in ``order`` (private, then
        shared, for a first come, first served model), blocking up to block_ms if none."""
        if self._unacked:
            self.ack()
        try:
            entries = self._read(count, block_ms)
        except redis.ResponseError as exc:
            if not _lost_group(exc):
                raise
            self.ensure_group()  # Redis restarted empty: recreate the groups and carry on
            return []
        jobs = []
        for entry_id, fields in entries:
            job = self._parse(entry_id, fields)
            if job is not None:
                jobs.append((entry_id, job))
        return jobs

    def _read(self, count: int, block_ms: int) -> list:
        entries, self._surplus = self._surplus[:count], self._surplus[count:]
        now = time.monotonic()
        if now - self._last_reclaim >= RECLAIM_EVERY_S:
            self._last_reclaim = now
            for stream in self.order:
                entries += self._reclaim(stream, count - len(entries))
            entries += self._stranded(count - len(entries))
        if now - self._last_adopt >= ADOPT_EVERY_S:
            self._last_adopt = now
            entries += self.adoption.adopt(count - len(entries))
        if len(entries) < count and block_ms > 0 and not entries:
            if self.bands and (entries := self._new_all(count)):
                return entries  # a backlog in several bands would answer the blocking read with count from each
            # one call blocks on every stream; COUNT is per stream, so a rare double answer leaves a surplus
            got = self.redis.xreadgroup(keys.PREFILL_GROUP, self.consumer, dict.fromkeys(self.order, ">"),
                                        count=count, block=block_ms)
            for stream, items in got or []:
                entries += [(self._tag(stream, eid), fields) for eid, fields in items]
            entries, self._surplus = entries[:count], entries[count:]
        elif len(entries) < count:
            entries += self._new_all(count - len(entries))
        return entries

    def _new_all(self, count: int) -> list:
        """Without blocking: each stream of ``order`` in turn, in one round trip. A busy worker reads every
        engine step, and a round trip per stream was a tenth of a CPU unified worker's step."""
        got = self.redis.eval(_READ_IN_ORDER, len(self.order), *self.order, keys.PREFILL_GROUP, self.consumer, count)
        return [(self._tag(stream, eid), dict(zip(flat[::2], flat[1::2], strict=True)))
                for stream, items in got for eid, flat in items]

    def _stranded(self, count: int) -> list:
        """Jobs left in the band streams of a model now served first come, first served (with a dead taker's
        pending ones): an XLEN per band at the reclaim pace, so a model that never had bands pays one round
        trip a second and reads nothing more."""
        if not self.stranded or count <= 0:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.stranded:
            pipe.xlen(stream)
        found = []
        for stream, length in zip(self.stranded, pipe.execute(), strict=True):
            if length and len(found) < count:
                self._join(stream)
                found += self._reclaim(stream, count - len(found))
                found += self._new(stream, count - len(found))
        return found

    def _join(self, stream: str, mkstream: bool = False) -> None:
        try:  # id "0": jobs queued before the first worker started are still delivered
            self.redis.xgroup_create(stream, keys.PREFILL_GROUP, id="0", mkstream=mkstream)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _new(self, stream: str, count: int) -> list:
        if count <= 0:
            return []
        got = self.redis.xreadgroup(keys.PREFILL_GROUP, self.consumer, {stream: ">"}, count=count)
        return [(self._tag(stream, eid), fields) for _stream, items in got or [] for eid, fields in items]

    def _tag(self, stream: str | bytes, entry_id: bytes) -> bytes:
        stream = stream.decode() if isinstance(stream, bytes) else stream
        return entry_id if stream == self.stream else stream.encode() + _SEP + entry_id

    def _where(self, tagged: bytes) -> tuple[str, bytes]:
        if _SEP not in tagged:
            return self.stream, tagged
        stream, entry_id = tagged.rsplit(_SEP, 1)
        return stream.decode(), entry_id

    def _reclaim(self, stream: str, count: int) -> list:
        if count <= 0:
            return []
        reply = self.redis.xautoclaim(stream, keys.PREFILL_GROUP, self.consumer, self.reclaim_idle_ms,
                                      start_id="0-0", count=count)
        kept = []
        for entry_id, fields in reply[1]:
            if not fields:
                continue  # deleted while pending
            tagged = self._tag(stream, entry_id)
            info = self.redis.xpending_range(stream, keys.PREFILL_GROUP, min=entry_id, max=entry_id, count=1)
            deliveries = (info[0]["times_delivered"] if info else 1) + int(fields.get(PRIOR_FIELD, 0))
            if deliveries > self.max_deliveries:
                reason = f"job failed on {deliveries - 1} workers"
                self.dead_letter(tagged, fields, reason)
                job = self._parse(tagged, fields)
                if job is not None and self.on_dead is not None:
                    self.on_dead(job.request_id, job.reply_addr, f"request failed repeatedly: {reason}")
            else:
                log.info("reclaimed job %s (delivery %d)", tagged, deliveries)
                kept.append((tagged, fields))
        return kept

    def _take_from_peer(self, stream: str, count: int, pending: bool) -> list:
        """Undelivered jobs of a peer's private stream, after its ``pending`` ones (a dead peer's): what
        job_adoption.py adopts, read as ours."""
        if count <= 0:
            return []
        try:
            entries = self._reclaim(stream, count) if pending else []  # XAUTOCLAIM counts the delivery
            return entries + self._new(stream, count - len(entries))
        except redis.ResponseError as exc:
            if not _lost_group(exc):
                raise
            return []  # its stream is gone (forgotten by a peer, or Redis restarted): nothing routed there

    def _parse(self, entry_id: bytes, fields: dict) -> Job | None:
        raw = fields.get(keys.JOB_FIELD.encode())
        try:
            if raw is None:
                raise ValueError(f"no {keys.JOB_FIELD!r} field")
            job = decode(raw, Job)
        except ValueError as exc:
            # a job of a newer gateway using what this worker lacks: its client hears so now, not at its deadline
            addressed = peek_strings(raw, "request_id", "reply_addr") if raw is not None else {}
            self._refuse(entry_id, fields, addressed.get("request_id"), addressed.get("reply_addr"),
                         f"malformed job: {exc}", f"this worker cannot run the job: {exc}")
            return None
        if why := version_refusal(job.protocol, f"the gateway at {job.reply_addr}"):
            if self._first_refusal(job.reply_addr):
                log.warning("refusing the jobs of %s", why)
            self._refuse(entry_id, fields, job.request_id, job.reply_addr, why,
                         f"this worker cannot run the job: {why}", quiet=True)
            return None
        return job

    def _first_refusal(self, reply_addr: str) -> bool:
        """Is this gateway's job the first refused? Said once per gateway: every job of a gateway too far apart
        is refused alike. The least recently refused are forgotten past FAR_GATEWAYS_KEPT."""
        known = reply_addr in self._far_gateways
        self._far_gateways[reply_addr] = None
        self._far_gateways.move_to_end(reply_addr)
        while len(self._far_gateways) > FAR_GATEWAYS_KEPT:
            self._far_gateways.popitem(last=False)
        return not known

    def _refuse(self, entry_id: bytes, fields: dict, request_id: str | None, reply_addr: str | None, reason: str,
                to_client: str, quiet: bool = False) -> None:
        """Dead-letter (so ACK) a job this worker will not run and tell its client why, when it can be addressed."""
        self.dead_letter(entry_id, fields, reason, level=logging.DEBUG if quiet else logging.WARNING)
        if request_id is not None and reply_addr is not None and self.on_dead is not None:
            self.on_dead(request_id, reply_addr, to_client)

    def ack(self, *entry_ids: bytes) -> None:
        """ACK and delete ``entry_ids``, and any earlier ACK that failed (even while draining, when no
        fetch comes to retry them)."""
        entry_ids, self._unacked = (*self._unacked, *entry_ids), []
        if not entry_ids:
            return
        pipe = self.redis.pipeline(transaction=True)
        for stream, ids in self._by_stream(entry_ids).items():
            pipe.xack(stream, keys.PREFILL_GROUP, *ids)
            pipe.xdel(stream, *ids)
        try:
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.health.failed(exc)  # said once per outage, however many ACKs wait
            self._unacked.extend(entry_ids)

    def ack_later(self, entry_id: bytes) -> None:
        """ACKed by the next ``ack()`` (or fetch), with whatever else is due then."""
        self._unacked.append(entry_id)

    def keep(self, entry_ids: Iterable[bytes]) -> None:
        """Mark our pending ``entry_ids`` as still being worked on: a job running longer than
        ``reclaim_idle_ms`` (a long generation on a unified worker) otherwise looks abandoned, and
        XAUTOCLAIM, ours or a peer's, delivers it again, counting a failure each time until a crash of
        ours dead-letters it instead of letting our successor resume it. XCLAIM with JUSTID resets the
        idle time without counting a delivery. A surplus delivered beyond what the caller asked for is ours
        as well: it is served once the caller has room."""
        by_stream = self._by_stream([*entry_ids, *(eid for eid, _ in self._surplus)])
        if not by_stream:
            return
        pipe = self.redis.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, keys.PREFILL_GROUP, self.consumer, 0, ids, justid=True)
        try:
            pipe.execute()
        except redis.ResponseError as exc:
            if not _lost_group(exc):
                raise
            self.ensure_group()  # Redis restarted empty: nothing of ours is pending there to keep

    def _by_stream(self, tagged: Iterable[bytes]) -> dict[str, list[bytes]]:
        groups: dict[str, list[bytes]] = {}
        for t in tagged:
            stream, entry_id = self._where(t)
            groups.setdefault(stream, []).append(entry_id)
        return groups

    def hand_back(self, entry_ids: list[bytes]) -> None:
        """Give our pending jobs up without finishing them. Shared-stream jobs (any band's) stay pending (nothing
        is lost if we die here) but look idle for a day, so the next reclaim pass of any worker takes them;
        JUSTID keeps their delivery count, so a hand-back does not push a job toward the dead-letter
        stream. Private ones, and whatever our private stream still holds undelivered, move to the shared
        stream (peers read a live worker's private stream only while it is stalled), their delivery count carried
        along."""
        entry_ids = [*entry_ids, *(eid for eid, _ in self._surplus)]
        self._surplus = []
        for stream, ids in self._by_stream(entry_ids).items():
            if stream == self.stream or stream in self.bands:
                self.redis.xclaim(stream, keys.PREFILL_GROUP, self.consumer, 0, ids,
                                  idle=HAND_BACK_IDLE_MS, justid=True)
            else:
                self._move_to_shared(stream, ids, delivered=True)
        while undelivered := self._new(self.private, 100):
            self._move_to_shared(self.private, [self._where(t)[1] for t, _ in undelivered], delivered=False)

    def _move_to_shared(self, stream: str, ids: list[bytes], delivered: bool) -> None:
        """Re-XADD our pending ``ids`` of ``stream`` to the shared stream, then ACK and delete them there. A
        private stream holds band-0 jobs only (the gateway routes no other band there), so band 0 it is.
        A delivery that really happened still counts toward the dead letter (as JUSTID keeps it on the
        shared stream); our read of an undelivered entry, only made to move it, does not."""
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(stream, min=entry_id, max=entry_id, count=1)
            pipe.xpending_range(stream, keys.PREFILL_GROUP, min=entry_id, max=entry_id, count=1)
        replies = pipe.execute()
        move = self.redis.pipeline(transaction=True)  # MULTI: afterwards the job is in exactly one of the two streams
        for found, pending in zip(replies[::2], replies[1::2], strict=True):
            if not found:
                continue  # deleted meanwhile (aborted and ACKed)
            _entry_id, fields = found[0]
            count = pending[0]["times_delivered"] if pending and delivered else 0
            prior = count + int(fields.get(PRIOR_FIELD, 0))
            move.xadd(self.stream, {**fields, PRIOR_FIELD: prior}, maxlen=keys.STREAM_MAXLEN, approximate=True)
        move.xack(stream, keys.PREFILL_GROUP, *ids)
        move.xdel(stream, *ids)
        move.execute()
        log.info("moved %d job(s) from %s to the shared stream", len(ids), stream)

    def dead_letter(self, entry_id: bytes, fields: dict, reason: str, level: int = logging.WARNING) -> None:
        stream, raw_id = self._where(entry_id)
        log.log(level, "job %s -> dead letter: %s", entry_id, reason)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.dead, {**fields, b"reason": reason.encode(), b"entry": raw_id}, maxlen=keys.STREAM_MAXLEN,
                  approximate=True)
        pipe.xack(stream, keys.PREFILL_GROUP, raw_id)
        pipe.xdel(stream, raw_id)
        pipe.execute()
