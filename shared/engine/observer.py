"""What watches an engine core without steering it (worker metrics), called on the engine's thread."""

from typing import Protocol

from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler_output import SchedulerOutput


class EngineObserver(Protocol):
    def on_step(self, started: float, out: SchedulerOutput, finished: list[Request]) -> None:
        """After every step: its unix start time, what was scheduled, and the requests it finished."""

    def on_removed(self, requests: list[Request]) -> None:
        """Requests ended from outside the step: aborts, stop strings."""
