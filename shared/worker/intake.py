"""Jobs in, for the roles that read the model streams (prefill, unified): one JobQueue per hosted
instance, read up to what the engine has room for, checked, and tracked in the worker's Lifecycle until
the request leaves, when its entry is ACKed (``release``). What each role then does with the engine's
output is its own (prefill_worker/worker.py, unified_worker/worker.py).

The jobs it holds are kept (``JobQueue.keep``) by a thread of their own, the job keeper, three times per
``reclaim_idle_ms``, from the entry ids the loop snapshots at the end of a turn: kept between steps only, a
step longer than the reclaim time (a long prefill on a CPU) would let peers reclaim and run again the jobs of a
worker that is alive and serving them. An id that left meanwhile costs nothing (XCLAIM skips an entry no
longer pending); one handed back meanwhile waits up to ``reclaim_idle_ms`` more for a peer."""

import logging
import threading
import time
from collections.abc import Callable

import redis

from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.job_queue import JobQueue
from kvrelay.shared.wire.priority_bands import shared_streams
from kvrelay.shared.wire.protocol import Job, TokenEvent
from kvrelay.shared.worker.lifecycle import InFlight, Lifecycle, engine_request
from kvrelay.shared.worker.model_slot import ModelSlot
from kvrelay.shared.worker.runtime import WorkerRuntime
from kvrelay.shared.worker.turn_snapshot import TurnSnapshot

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 50  # one model and nothing running: the read blocks this long for a job
IDLE_SLEEP_S = 0.005  # several models: each stream is polled without blocking, then this nap
# While Redis is unreachable no new job can come, but what the engine holds runs on: reads are tried
# again this often, not every step (each failed read costs its retries, about a second).
OUTAGE_RETRY_S = 1.0
KEEPS_PER_RECLAIM = 3  # a job is kept this often within the time after which peers reclaim it


class JobIntake:
    def __init__(self, runtime: WorkerRuntime, config: WorkerConfig, ack_after_events: bool = False):
        """``ack_after_events``: a released job's ACK waits for ``send_acks``, which the role calls after
        its step's events are flushed, so the gateway hears of a finished request before Redis is asked
        anything, and a step's ACKs go in one round trip, not one each."""
        self.runtime = runtime
        self.config = config
        self.ack_after_events = ack_after_events
        self.queues: dict[str, JobQueue] = {}
        # no worker_id on events: a dead stream worker's jobs are reclaimed by a peer, not failed
        self.inflight = Lifecycle(runtime, release=self._release)
        # instance -> entry ids of our jobs held past the engine (a prefill worker's awaiting their handoff)
        self.held_elsewhere: Callable[[str], list[bytes]] = lambda instance: []
        self.held = TurnSnapshot(self._held_now)
        self._fetched: dict[str, list[bytes]] = {}  # instance -> entry ids of its latest read, maybe not admitted yet
        runtime.turn_snapshots.append(self.held)
        runtime.role_threads["job keeper"] = self.keep_held
        runtime.registration.on_restore.append(self.restore)
        self._retry_at = 0.0  # monotonic: no read before it (Redis unreachable)
        self._asked: dict[str, float] = {}  # instance -> unix seconds its latest read was issued

    def attach(self, slot: ModelSlot) -> None:
        c = self.config
        self.queues[slot.instance] = JobQueue(self.runtime.redis, slot.instance, c.worker_id, c.reclaim_idle_ms,
                                              c.max_deliveries, on_dead=self._dead_job, health=self.runtime.health,
                                              stalled_step_timeout_s=c.stalled_step_timeout_s,
                                              priority_bands=slot.core.scheduling_policy == "priority")

    def restore(self) -> None:
        """Redis restarted (the heartbeat thread calls this): our consumer groups again, where it lost
        them, before a gateway routes a job to a private stream nobody reads (JobQueue's own NOGROUP
        recovery would only come with the next read)."""
        for queue in list(self.queues.values()):
            queue.ensure_group()

    def detach(self, slot: ModelSlot) -> None:
        self.queues.pop(slot.instance, None)

    def idle(self, slot: ModelSlot) -> bool:
        queue = self.queues.get(slot.instance)
        return (not self.inflight.holds(slot.instance)
                and queued(self.runtime.redis, slot.instance, self.config.worker_id,
                           banded=queue is not None and bool(queue.bands)) == 0)

    def busy(self, slot: ModelSlot) -> bool:
        return self.inflight.holds(slot.instance)

    def fetch(self, slot: ModelSlot, block_ms: int) -> list[tuple[bytes, Job]]:
        """Jobs for ``slot``, up to what its engine has room for; none while Redis is unreachable (the
        outage is reported, and the step goes on with what the engine holds)."""
        if time.monotonic() < self._retry_at:
            if block_ms:  # idle: the read would have blocked this long; no spinning on a dead Redis
                time.sleep(block_ms / 1000)
            return []
        try:
            self._asked[slot.instance] = time.time()
            jobs = self._fetch(slot, block_ms)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.runtime.health.failed(exc)
            self._retry_at = time.monotonic() + OUTAGE_RETRY_S
            return []
        self._fetched[slot.instance] = [entry_id for entry_id, _ in jobs]
        if jobs:  # kept from now on, though the step that runs them may not end for long
            self.held.take_now()
        return jobs

    def _fetch(self, slot: ModelSlot, block_ms: int) -> list[tuple[bytes, Job]]:
        room = slot.core.max_num_seqs - self.inflight.count(slot.instance)
        if room <= 0 or self.runtime.draining or not slot.reading:  # not reading: evicted, finishing what runs
            return []
        jobs = self.queues[slot.instance].fetch(room, block_ms=block_ms)
        if jobs and self.runtime.draining:  # SIGTERM landed during the read: a peer starts these
            self.queues[slot.instance].hand_back([entry_id for entry_id, _ in jobs])
            return []
        return jobs

    def keep_held(self, stop: threading.Event) -> None:
        """The job keeper's thread, until ``stop``: our jobs must not look abandoned to XAUTOCLAIM."""
        period = self.config.reclaim_idle_ms / 1000 / KEEPS_PER_RECLAIM
        while not stop.wait(period / 2):
            held = self.held.latest(period / 2) or {}  # the turn in progress may end meanwhile
            try:
                for instance, ids in held.items():
                    queue = self.queues.get(instance)
                    if queue is not None:
                        queue.keep(ids)
            except redis.RedisError as exc:  # an outage: kept again once Redis is back
                if not self.runtime.health.absorb(exc):
                    log.warning("could not keep our jobs: %s", exc)

    def _held_now(self) -> dict[str, list[bytes]]:
        """instance -> entry ids of the jobs we hold; taken by the loop at the end of a turn."""
        held: dict[str, list[bytes]] = {instance: [] for instance in self.queues}
        for r in self.inflight.requests.values():
            if r.entry_id and r.instance in held:
                held[r.instance].append(r.entry_id)
        for instance, ids in held.items():
            ids += self.held_elsewhere(instance) + self._fetched.get(instance, [])
        return held

    def admit(self, slot: ModelSlot, entry_id: bytes, job: Job) -> tuple[InFlight, Request] | None:
        """The tracked record and engine request of a fetched job; None for one that is ours already (our
        own pending job reclaimed back to us), aborted or past its deadline, or invalid (those are answered
        and ACKed here)."""
        slot.touch()
        rid = job.request_id
        if rid in self.inflight:
            return None
        if (job.deadline and time.time() > job.deadline) or self.inflight.unwanted(job):
            self.answer(slot.instance, entry_id, job, TokenEvent(request_id=rid, finish_reason="abort"))
            return None
        try:
            req = engine_request(slot, job)
        except (ValueError, TypeError) as exc:
            self.answer(slot.instance, entry_id, job, TokenEvent(request_id=rid, finish_reason="error", error=str(exc)))
            return None
        slot.note_request()
        rec = InFlight(request_id=rid, instance=slot.instance, reply_addr=job.reply_addr, deadline=job.deadline,
                       arrival=job.arrival, max_tokens=req.max_tokens, job=job, entry_id=entry_id,
                       fetched_at=time.time(), asked_at=self._asked.get(slot.instance, 0.0))
        self.inflight.track(rec)
        return rec, req

    def answer(self, instance: str, entry_id: bytes, job: Job, event: TokenEvent) -> None:
        """End a job no record tracks (any more): its last event, then its ACK."""
        self.runtime.events.add(job.reply_addr, event)
        self.ack(instance, entry_id)

    def ack(self, instance: str, entry_id: bytes) -> None:
        q = self.queues.get(instance)
        if q is not None:
            q.ack(entry_id)

    def hand_back(self, entries: list[tuple[str, bytes]]) -> None:
        """(instance, entry id) each: back to the stream for a peer."""
        by_instance: dict[str, list[bytes]] = {}
        for instance, entry_id in entries:
            by_instance.setdefault(instance, []).append(entry_id)
        for instance, ids in by_instance.items():
            if instance in self.queues:
                self.queues[instance].hand_back(ids)

    def _release(self, rec: InFlight) -> None:
        q = self.queues.get(rec.instance)
        if q is not None and self.ack_after_events:
            q.ack_later(rec.entry_id)
        elif q is not None:
            q.ack(rec.entry_id)

    def send_acks(self) -> None:
        for q in self.queues.values():
            q.ack()

    def _dead_job(self, request_id: str, reply_addr: str, why: str) -> None:
        self.runtime.events.add(reply_addr, TokenEvent(request_id=request_id, finish_reason="error", error=why))


def queued(r, instance: str, worker_id: str, banded: bool = False) -> int:
    """Jobs of ``instance`` still in Redis that this worker could be the one to serve: its shared stream
    (every priority band's, where ``banded``) and this worker's private stream (entries are deleted when
    ACKed, so pending ones count too)."""
    pipe = r.pipeline(transaction=False)
    for stream in shared_streams(instance) if banded else [keys.prefill_stream(instance)]:
        pipe.xlen(stream)
    pipe.xlen(keys.prefill_worker_stream(instance, worker_id))
    return sum(pipe.execute())
