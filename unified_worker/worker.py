"""Unified worker: one process pulls jobs, prefills and decodes them, no handoff. For comparison with
the disaggregated path and for small setups (`kvrelay serve --mode unified`).

Lifecycle of one job here: XREADGROUP/XAUTOCLAIM -> validate -> engine (continuous batching, chunked
prefill) -> token events to the gateway every step -> finished, or ended by the worker's Lifecycle
(shared/worker/lifecycle.py: a gateway's abort, the deadline, a dead gateway) -> XACK. The job is ACKed
only when the request ends, so a killed worker's jobs are reclaimed by a peer.
SIGTERM drains: no new jobs are read, running ones finish (up to the drain timeout), the rest are handed
back to the stream or, when a peer could not continue their text exactly, ended (``_abandon``).
Several models: one JobQueue and engine per hosted instance, served in turn (as the prefill worker).
"""

import logging
import time

from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.wire.job_queue import replayable
from kvrelay.shared.worker.intake import IDLE_BLOCK_MS, IDLE_SLEEP_S, JobIntake
from kvrelay.shared.worker.model_slot import ModelSlot
from kvrelay.shared.worker.runtime import WorkerRuntime
from kvrelay.shared.worker.token_event import stamp_first_token, token_event

log = logging.getLogger(__name__)


class UnifiedWorker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.runtime = WorkerRuntime(config)
        self.intake = JobIntake(self.runtime, config, ack_after_events=True)
        self.inflight = self.intake.inflight

    def run(self) -> None:
        self.runtime.start(zmq_addr="", hooks=self)
        self.runtime.serve_forever(self.step, busy=lambda: bool(self.inflight), abandon=self._abandon)

    # -- RoleHooks ----------------------------------------------------------------------------------
    def attach(self, slot: ModelSlot) -> None:
        self.intake.attach(slot)

    def detach(self, slot: ModelSlot) -> None:
        self.intake.detach(slot)

    def idle(self, slot: ModelSlot) -> bool:
        return self.intake.idle(slot)

    def may_unload(self, slot: ModelSlot) -> bool:
        return self.idle(slot)

    def busy(self, slot: ModelSlot) -> bool:
        return self.intake.busy(slot)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        self.inflight.sweep()
        slots = list(self.runtime.slots.values())
        busy = any(s.core.has_unfinished() for s in slots)
        block_ms = 0 if busy or len(slots) != 1 else IDLE_BLOCK_MS
        fetched = 0
        for slot in slots:
            for entry_id, job in self.intake.fetch(slot, block_ms):
                fetched += 1
                admitted = self.intake.admit(slot, entry_id, job)
                if admitted is not None:
                    slot.core.add_request(admitted[1])
        for slot in slots:
            if slot.core.has_unfinished():
                self._step_model(slot)
        self.runtime.events.flush()
        self.intake.send_acks()
        if not slots:
            self.runtime.stop.wait(0.02)  # nothing loaded yet: wait for a load command
        elif len(slots) > 1 and not (busy or fetched):
            time.sleep(IDLE_SLEEP_S)

    def _step_model(self, slot: ModelSlot) -> None:
        slot.touch()
        step_started = time.time()
        for out in slot.core.step():
            rec = self.inflight.get(out.request_id)
            if rec is None:
                continue
            event = token_event(out, rec.sent, worker_id="")
            stamp_first_token(event, rec, step_started)
            if out.finished:
                self.inflight.finish(rec.request_id, event)
            else:
                self.inflight.send(rec, event)

    def _abandon(self) -> None:
        """Drain timeout. A job with no token sent yet, or a greedy/seeded one (a peer re-running it
        repeats the tokens the client has, which the gateway drops as duplicates), goes back to the
        stream; any other ends with an error event, since a peer would continue a different text."""
        back = []
        for rec in self.inflight.abandon():
            if rec.job is None or rec.sent == 0 or replayable(rec.job):
                back.append((rec.instance, rec.entry_id))
            else:
                self.intake.answer(rec.instance, rec.entry_id, rec.job, self.inflight.end_event(
                    rec, "error", "worker shut down before the request finished"))
        self.intake.hand_back(back)
        log.info("handed %d job(s) back to the stream", len(back))
