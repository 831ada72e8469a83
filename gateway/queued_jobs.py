"""Where each waiting request's jobs sit in Redis, so that after a Redis restart the gateway can ask
Redis which of them it kept instead of assuming all were lost.

A Redis that comes back from its file (``kvrelay serve``'s append-only file, or any persistent Redis)
still holds the jobs it had saved; one that comes back empty, or lost its last second, does not. A
request keeps waiting when every job it still expects from Redis is there: a worker reads it in time,
or holds it already (an entry stays in its stream until the worker ACKs it, which it does only once
the gateway has heard from it or the job moved on to a decode worker that tells the gateway). A
request with any job gone fails at once (``Generation``: 503 ``queue_lost``).

The check is one pipelined round trip whatever the number of requests: per stream, a script tests the
entries the gateway recorded at XADD (``XRANGE id id``) and answers one flag each, not the jobs
themselves (their prompts can be large), at most ``CHUNK`` ids per script call so that no single call
holds Redis for long.

A job that a draining worker moved from its private stream to the shared one has a new entry id there,
so it reads as gone: its request fails as it would have without this check.
"""

import logging
import time
from dataclasses import dataclass, field

import redis.asyncio

log = logging.getLogger("kvrelay.gateway")

CHUNK = 1000  # ids per script call: a call over 1000 entries takes about a millisecond of Redis
# one flag per ARGV id: whether the stream KEYS[1] still holds that entry (a missing stream holds none)
_PRESENT = """
local out = {}
for i, id in ipairs(ARGV) do
  out[i] = #redis.call('XRANGE', KEYS[1], id, id, 'COUNT', 1)
end
return out
"""


@dataclass(eq=False)
class QueuedRequest:
    """One request's jobs in Redis: ``jobs`` maps a job id to (stream, entry id) until some worker is
    heard from for it (``heard``); ``gone`` holds the jobs a restart check found missing."""

    queued_at: float  # monotonic, when Redis answered the XADDs
    jobs: dict[str, tuple[str, bytes]]
    gone: set[str] = field(default_factory=set)

    def heard(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        self.gone.discard(job_id)

    @property
    def lost(self) -> bool:
        """A job this request still waits for is no longer in Redis: nobody will ever read it."""
        return bool(self.gone)


class QueuedJobs:
    def __init__(self, client: redis.asyncio.Redis):
        self._redis = client
        self._requests: set[QueuedRequest] = set()

    def add(self, queued_at: float, jobs: dict[str, tuple[str, bytes]]) -> QueuedRequest:
        request = QueuedRequest(queued_at, jobs)
        self._requests.add(request)
        return request

    def discard(self, request: QueuedRequest) -> None:
        self._requests.discard(request)

    def __len__(self) -> int:
        return len(self._requests)

    async def recheck(self, queued_before: float) -> tuple[int, int]:
        """After a restart: mark the jobs of requests queued before ``queued_before`` (monotonic) that
        Redis no longer holds. Returns (requests checked, requests now lost). Raises what Redis raises;
        nothing is marked then."""
        waiting = [r for r in self._requests if r.queued_at < queued_before and r.jobs]
        by_stream: dict[str, set[bytes]] = {}
        for request in waiting:
            for stream, entry_id in request.jobs.values():
                by_stream.setdefault(stream, set()).add(entry_id)
        if not by_stream:
            return 0, 0
        started = time.monotonic()
        calls: list[tuple[str, list[bytes]]] = []
        pipe = self._redis.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            ordered = sorted(ids)
            for i in range(0, len(ordered), CHUNK):
                chunk = ordered[i:i + CHUNK]
                pipe.eval(_PRESENT, 1, stream, *chunk)
                calls.append((stream, chunk))
        replies = await pipe.execute()
        present = {(stream, entry_id) for (stream, chunk), flags in zip(calls, replies, strict=True)
                   for entry_id, flag in zip(chunk, flags, strict=True) if flag}
        lost = 0
        # jobs heard from during the round trip left ``jobs`` meanwhile; none was added
        for request in waiting:
            request.gone.update(job for job, where in request.jobs.items() if where not in present)
            lost += request.lost
        log.info("redis restart: %d of %d waiting request(s) lost a queued job (%d entries checked in %.0f ms)",
                 lost, len(waiting), sum(len(c) for _, c in calls), (time.monotonic() - started) * 1000)
        return len(waiting), lost
