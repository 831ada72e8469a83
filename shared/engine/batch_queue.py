"""Pipeline parallelism without a drain at every step (vLLM's batch queue, ``--pipeline-batch-queue``): with M
stages, rank 0 keeps up to M micro-batches of DISJOINT requests in flight, so stage k works on one while stage
k+1 works on another across step boundaries, instead of every step running its micro-batches through the
pipeline and waiting for the last one's logits (ranks/pipe_driver.py ``pipeline_step``).

Lifecycle of a micro-batch (``EngineCore.step`` = one ``BatchQueueStepper.step``):
  1. fill: while fewer than M micro-batches are in flight, schedule one from the requests NOT in flight
     (``Scheduler.schedule(busy=...)``: in-flight requests are neither scheduled nor preempted, since their next
     token is not sampled yet and their micro-batch still writes their blocks), at most about 1/M of the
     unfinished requests, so the running set spreads over M micro-batches; launch it (its swap copies, its
     message to every stage, stage 0's forward on rank 0, its hidden states sent on, no waiting);
  2. land the oldest: receive its logits from the last stage, sample, and update the scheduler as synchronous
     stepping does (``update_from_output``: tokens computed, the sample appended, stops, full blocks into the
     prefix cache), and return its outputs. Its requests are free again: the next step's fill schedules their
     next tokens (and waiting prompts) into a micro-batch of their own.
A request is therefore in at most one micro-batch in flight, and from its schedule to its update nothing else
touches it: it sees exactly synchronous stepping (min_tokens, penalties and grammars count no pending token),
so its tokens are synchronous stepping's.

Why the rest stays correct: every stage runs the micro-batches in launch order (its steps arrive in order and
each waits for the previous stage's output), so blocks freed by an abort of an in-flight request and handed to
a later micro-batch are written by the later one after the earlier one's write, as with async scheduling. An
abort or a stop string while in flight discards the landed token (``apply_sampled``). Any other message to the
ranks (swap copies, KV handoff moves, stop) first waits for every micro-batch in flight to reach rank 0
(``settle``), because those messages pair rank 0 with ranks that would otherwise still be busy in a step.
The engine counts as unfinished while micro-batches are in flight, so its owner steps until they land.
"""

import dataclasses
import math
import time
from collections import deque

from kvrelay.shared.engine.async_step import AsyncStepper
from kvrelay.shared.engine.outputs import EngineCoreOutput
from kvrelay.shared.engine.ranks.pipe_driver import MicroBatch
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import SchedulerOutput


class BatchQueueStepper(AsyncStepper):
    """``EngineCore.step`` under pipeline parallelism with up to ``depth`` micro-batches in flight."""

    def __init__(self, *args, depth: int) -> None:
        super().__init__(*args)
        self.depth = depth
        self.queue: deque[MicroBatch] = deque()
        self.runner.ranks.before_other = self.settle
        self.max_in_flight = 0  # the most micro-batches ever in flight at once (tests check the overlap)

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def settle(self) -> None:
        """Wait until every stage is done with every micro-batch in flight (nothing is sampled yet)."""
        for mb in self.queue:
            self.runner.receive(mb)

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        while len(self.queue) < self.depth and self._launch(outputs):
            self.max_in_flight = max(self.max_in_flight, len(self.queue))
        if self.queue:
            outputs += self._land(self.queue.popleft())
        return outputs

    def _launch(self, outputs: list[EngineCoreOutput]) -> bool:
        """Schedule and launch one micro-batch of requests not in flight; False when none was launched."""
        sched, observer = self.scheduler, self.observer()
        busy = frozenset(s.request.request_id for mb in self.queue for s in mb.out.scheduled)
        share = math.ceil((sched.num_running + sched.num_waiting) / self.depth)
        out = sched.schedule(busy, max(1, share))
        mb = self.runner.launch_micro(out, list(self.queue))
        if out.aborted:  # ended by the scheduler: reported now
            outputs += [self.output(req, None, True) for req in out.aborted]
            if observer is not None:
                observer.on_removed(list(out.aborted))
        if mb is None:
            if observer is not None:
                observer.on_step(time.time(), out, [])
            return False
        self.queue.append(mb)
        return True

    def _land(self, mb: MicroBatch) -> list[EngineCoreOutput]:
        step = self.runner.land(mb)
        for rid, (pos0, chunk) in step.prompt_logprobs.items():
            if rid in self.prompt_logprobs:  # not aborted while in flight
                self.prompt_logprobs[rid][pos0 + 1:pos0 + 1 + len(chunk)] = chunk
        return self._finish(step)

    def _apply(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        # as synchronous stepping: computed and sampled counted at once (its aborted were reported at launch)
        return self.scheduler.update_from_output(dataclasses.replace(out, aborted=[]),
                                                 {rid: [token] for rid, token in sampled.items()})
