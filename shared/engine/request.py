"""One sequence's state inside an engine (vLLM V1 style).

Prefill, chunked prefill and decode are one mechanism: each step the scheduler grants a request up
to ``num_tokens - num_computed_tokens`` new tokens; when a step computes its last known token, the
runner samples the next one. ``n > 1`` and beam search fan out into several requests above this level.
"""

import enum
import time
from dataclasses import dataclass, field

from kvrelay.shared.wire.block_hash import DEFAULT_TENANT
from kvrelay.shared.wire.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; KV dropped (recompute) or swapped to host
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved against the context length by the engine
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # mixed into prefix-cache hashes so tenants never share blocks
    # Who the request is for: the scheduler shares capacity fairly between tenants, and the block manager
    # folds the tenant into the cache namespace too, so isolation does not hinge on the salt alone.
    tenant: str = DEFAULT_TENANT
    # Unix time the request entered the system (the gateway's Job.arrival in workers): latency metrics
    # (TTFT, e2e, queue time) count from it, across processes, so it cannot be a monotonic clock.
    arrival_wall: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    swapped_blocks: list[int] | None = None  # host block ids while swapped out
    # Async scheduling (shared/engine/async_step.py): tokens sampled on the device whose ids the host has
    # not read yet (0 or 1). They count for scheduling (the next step decodes them) but are not in
    # output_token_ids until read; always 0 without async scheduling.
    num_pending: int = 0
    # Structured outputs (shared/engine/structured/): the constraint's compile and this sequence's matcher;
    # None for an unconstrained request. A structured.matcher.SequenceGrammar, typed loosely because that
    # package imports this module.
    grammar: object | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished
