"""Workers whose engine loop stopped stepping: live by their heartbeat, which does not wait for steps
(shared/worker/registration.py), but in one step for longer than ``--stalled-step-timeout-s``
(shared/wire/step_stall.py). No new job is routed to one: its private stream gets none, and a model
only such workers hold answers 503 naming them, rather than queue requests that wait out their deadlines, and
``/ready`` counts it out. Jobs routed to its private stream that it has not read, its peers take
(shared/wire/job_adoption.py); those it read are its own to finish or, past the workers' ``--step-timeout``, lose
when it exits (their peers then run them again).

Judged afresh at each read of the workers (``WorkerRegistry.workers``), and logged once per stall: when it
begins and when the worker steps again, never per request.
"""

import logging

from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.step_stall import stalled, why_stalled

log = logging.getLogger("kvrelay.gateway")


class Stalls:
    def __init__(self, timeout_s: float):
        """``timeout_s``: the longest step a routable worker may be in (0: none is ever stalled)."""
        self.timeout_s = timeout_s
        self.ages: dict[str, float] = {}  # worker id -> its step's age, for those stalled as of the last read

    def update(self, workers: list[WorkerInfo]) -> None:
        """Judge a new read of the live workers."""
        ages = {w.worker_id: w.step_age_s for w in workers if stalled(w, self.timeout_s)}
        for worker_id in sorted(ages.keys() - self.ages.keys()):
            log.warning("worker %r is stalled (%s): no new jobs go to it until it steps again", worker_id,
                        self._why(ages[worker_id]))
        live = {w.worker_id for w in workers}
        for worker_id in sorted((self.ages.keys() - ages.keys()) & live):  # one that left says so itself
            log.info("worker %r steps again: new jobs go to it again", worker_id)
        self.ages = ages

    def routable(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        return [w for w in workers if w.worker_id not in self.ages]

    def describe(self, workers: list[WorkerInfo]) -> str:
        """Those of ``workers`` that are stalled, and why: for a client's 503."""
        return "; ".join(f"{w.worker_id} ({self._why(self.ages[w.worker_id])})"
                         for w in workers if w.worker_id in self.ages)

    def _why(self, age: float) -> str:
        return why_stalled(age, self.timeout_s)
