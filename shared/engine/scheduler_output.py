"""What the scheduler decides for one step, in block ids: the requests scheduled with their token counts
and block tables, the swap copies, the preempted and the aborted. The runner turns it into tensors
(model_runner.py); the scheduler (scheduler.py) produces it and advances requests by it."""

from dataclasses import dataclass, field

from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.step_cost import StepShape


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # full block table after allocation
    # This step computes the request's last known token, so the runner samples one. Fixed at schedule
    # time because update_from_output moves num_computed_tokens.
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        req = self.request  # a pending token (async scheduling) is known to exist, so it counts
        self.sample = req.num_computed_tokens + self.num_new_tokens == req.num_tokens + req.num_pending


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    aborted: list[Request] = field(default_factory=list)  # ended by the scheduler: can never fit
    shape: StepShape = field(default_factory=StepShape)  # its decode rows and prompt tokens (step_cost.py)
    # Set when its tokens are read, for observers: the seconds its requests waited for them (from its launch, or
    # the read of the step before if that is later: the gap inter-token latency sees), and with async scheduling
    # the shape of the step launched before that read, whose host launch (eager, when it holds prompt tokens)
    # is inside those seconds.
    seconds: float | None = None
    beside: StepShape | None = None

    @property
    def empty(self) -> bool:
        # Swap copies alone still need the runner: a swapped-out block may be reused next step.
        return not (self.scheduled or self.swap_out or self.swap_in)
