"""How often the decode loop starts a step while a prefill worker computes a prompt for it.

On one GPU the prefill and decode processes take turns (the driver time-slices their contexts). A decode
step reads every weight whatever its batch, so a decode loop that steps as fast as it can holds the GPU
about half the time even with a handful of requests, and the prefill step beside it takes about twice
as long: prompts queue in front of the prefill worker and time to first token grows, while inter-token
latency sits far under its SLO. Starting decode steps at most every ``interval`` leaves the gaps to the
prefill process, and each step carries more requests for the same weight read.

Paced only while KV is on its way here: a grant outstanding means a prefill worker is computing a prompt
whose KV comes to this worker (it asks just before the prompt's last chunk). With no prompt in flight
the loop steps at once, so a lone request's time per output token is the engine's.
"""

import time
from collections.abc import Callable


class StepPace:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.last_start: float | None = None

    def start_at(self, kv_arriving: bool) -> float | None:
        """When the next step may start (a ``clock`` time), or None to start it now."""
        if not self.interval_s or not kv_arriving or self.last_start is None:
            return None
        at = self.last_start + self.interval_s
        return at if at > self.clock() else None

    def started(self) -> None:
        self.last_start = self.clock()
