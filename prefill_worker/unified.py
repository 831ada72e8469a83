"""Unified worker: one process pulls jobs, prefills and decodes them, no handoff. For comparison with
the disaggregated path and for small setups (`kvrelay serve --mode unified`).

Lifecycle of one job here: XREADGROUP/XAUTOCLAIM -> validate -> engine (continuous batching, chunked
prefill) -> token events to the gateway every step -> finished, aborted or past its deadline -> XACK.
The job is ACKed only when the request ends, so a killed worker's jobs are reclaimed by a peer.
SIGTERM drains: no new jobs are read, running ones finish (up to the drain timeout), the rest are handed
back to the stream or, when a peer could not continue their text exactly, ended (``_abandon``).
Several models: one JobQueue and engine per hosted instance, served in turn (as the prefill worker).
"""

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from kvrelay.prefill_worker.job_queue import JobQueue, replayable
from kvrelay.prefill_worker.worker import IDLE_SLEEP_S, queued
from kvrelay.shared.wire.protocol import Job, TokenEvent
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.model_host import ModelSlot
from kvrelay.shared.worker.runtime import WorkerConfig, WorkerRuntime, token_event

log = logging.getLogger(__name__)


@dataclass
class _UnifiedModel:
    jobs: JobQueue
    active: dict[str, tuple[bytes, Job, int]] = field(default_factory=dict)  # id -> (entry, job, tokens sent)


class UnifiedWorker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.runtime = WorkerRuntime(config)

    def run(self) -> None:
        self.runtime.start(zmq_addr="", hooks=self)
        self.runtime.serve_forever(self.step, busy=lambda: any(s.role.active for s in self.runtime.slots.values()),
                                   abandon=self._abandon)

    # -- RoleHooks ----------------------------------------------------------------------------------
    def attach(self, slot: ModelSlot) -> None:
        c = self.config
        slot.role = _UnifiedModel(JobQueue(self.runtime.redis, slot.instance, c.worker_id, c.reclaim_idle_ms,
                                           c.max_deliveries, on_dead=self._dead_job))

    def detach(self, slot: ModelSlot) -> None:
        pass

    def idle(self, slot: ModelSlot) -> bool:
        return not slot.role.active and queued(self.runtime.redis, slot.instance, self.config.worker_id) == 0

    def may_unload(self, slot: ModelSlot) -> bool:
        return self.idle(slot)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        aborted = self.runtime.drain_aborts()
        now = time.time()
        slots = list(self.runtime.slots.values())
        for slot in slots:
            um: _UnifiedModel = slot.role
            expired = [rid for rid, (_, job, _) in um.active.items() if job.deadline and now > job.deadline]
            for rid in aborted + expired:
                if rid in um.active:
                    entry_id, job, sent = um.active.pop(rid)
                    slot.core.abort([rid])
                    self._end(um, entry_id, job, TokenEvent(request_id=rid, finish_reason="abort", output_index=sent))
        busy = any(s.core.has_unfinished() for s in slots)
        fetched = 0
        for slot in slots:
            um = slot.role
            room = slot.core.config.scheduler.max_num_seqs - len(um.active)
            if room > 0 and not self.runtime.draining:
                block_ms = 0 if busy or len(slots) != 1 else 50
                jobs = um.jobs.fetch(room, block_ms=block_ms)
                if jobs and self.runtime.draining:  # SIGTERM landed during the read: a peer starts these
                    um.jobs.hand_back([entry_id for entry_id, _ in jobs])
                    continue
                for entry_id, job in jobs:
                    fetched += 1
                    self._admit(slot, entry_id, job)
        for slot in slots:
            if slot.core.has_unfinished():
                self._step_model(slot)
        self.runtime.events.flush()
        if not slots:
            self.runtime.stop.wait(0.02)  # nothing loaded yet: wait for a load command
        elif len(slots) > 1 and not (busy or fetched):
            time.sleep(IDLE_SLEEP_S)

    def _step_model(self, slot: ModelSlot) -> None:
        um: _UnifiedModel = slot.role
        slot.touch()
        for out in slot.core.step():
            if out.request_id not in um.active:
                continue
            entry_id, job, sent = um.active[out.request_id]
            # no worker_id: a dead unified worker's jobs are reclaimed by a peer, not failed
            event = token_event(out, sent, worker_id="")
            if out.finished:
                del um.active[out.request_id]
                self._end(um, entry_id, job, event)
            else:
                um.active[out.request_id] = (entry_id, job, sent + len(out.new_token_ids))
                self.runtime.events.add(job.reply_addr, event)

    def _admit(self, slot: ModelSlot, entry_id: bytes, job: Job) -> None:
        um: _UnifiedModel = slot.role
        rid = job.request_id
        slot.touch()
        if rid in um.active:
            return  # reclaimed back to ourselves: still running here
        if job.deadline and time.time() > job.deadline:
            self._end(um, entry_id, job, TokenEvent(request_id=rid, finish_reason="abort"))
            return
        try:
            params = SamplingParams.from_dict(job.sampling)
            eos = slot.eos_ids
            if not params.ignore_eos:
                params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + eos[1:])
            req = slot.core.make_request(rid, job.prompt_token_ids, params, eos[0] if eos else None,
                                         job.priority, job.cache_salt, tenant=job.tenant, arrival=job.arrival)
        except (ValueError, TypeError) as exc:
            self._end(um, entry_id, job, TokenEvent(request_id=rid, finish_reason="error", error=str(exc)))
            return
        um.active[rid] = (entry_id, job, 0)
        slot.core.add_request(req)

    def _end(self, um: _UnifiedModel, entry_id: bytes, job: Job, event: TokenEvent) -> None:
        self.runtime.events.add(job.reply_addr, event)
        um.jobs.ack(entry_id)

    def _abandon(self) -> None:
        """Drain timeout. A job with no token sent yet, or a greedy/seeded one (a peer re-running it
        repeats the tokens the client has, which the gateway drops as duplicates), goes back to the
        stream; any other ends with an error event, since a peer would continue a different text."""
        total = 0
        for slot in self.runtime.slots.values():
            um: _UnifiedModel = slot.role
            back = []
            for rid, (entry_id, job, sent) in list(um.active.items()):
                slot.core.abort([rid])
                if sent == 0 or replayable(job):
                    back.append(entry_id)
                else:
                    self._end(um, entry_id, job, TokenEvent(
                        request_id=rid, finish_reason="error", output_index=sent,
                        error="worker shut down before the request finished"))
            um.active.clear()
            um.jobs.hand_back(back)
            total += len(back)
        log.info("handed %d job(s) back to the stream", total)

    def _dead_job(self, job: Job, reason: str) -> None:
        self.runtime.events.add(job.reply_addr, TokenEvent(request_id=job.request_id, finish_reason="error",
                                                           error=f"request failed repeatedly: {reason}"))
