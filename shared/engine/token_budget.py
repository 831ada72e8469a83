"""One step's token budget: how many new tokens the scheduler may still grant, and to whom.

Decodes come before prompt chunks in the budget: a prompt chunk is granted only what leaves a token for
every decode after it in the running list. While any request decodes, the step's prompt tokens are also
capped at ``max_prefill_tokens_with_decodes`` (Sarathi-Serve's stall-free batching), so a decode step
costs about the same with or without a long prompt beside it; with nothing decoding a prompt takes the
whole budget. Without chunked prefill a prompt is never split: it runs whole or waits.
With ``target_step_ms`` the cap follows the step's cost: the prompt tokens that a fit of this engine's
measured steps (step_cost.py) predicts the target leaves beside this step's decodes, between a floor
(prompts never starve) and ``max_prefill_tokens_with_decodes`` (0 there: the whole budget).
"""

from kvrelay.shared.config.engine import DEFAULT_STEP_TOKENS, SchedulerConfig
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.step_cost import StepCost, StepShape


def max_batched_tokens(config: SchedulerConfig, max_model_len: int) -> int:
    """The tokens one step may compute: ``max_num_batched_tokens``, or its default."""
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_STEP_TOKENS if config.enable_chunked_prefill else max_model_len
    if budget < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {budget}")
    if not config.enable_chunked_prefill and budget < max_model_len:
        # Without chunking a whole prompt must fit one step, or the longest prompts could never run.
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
            "when chunked prefill is disabled"
        )
    return budget


def is_decode(req: Request) -> bool:
    """Past its prompt, needing one token: a decode row (with async scheduling the token it needs
    is the pending one)."""
    return bool(req.num_output_tokens + req.num_pending) and \
        req.num_tokens + req.num_pending - req.num_computed_tokens == 1


class StepBudget:
    """What is left of one step's budget: ``tokens`` in all, ``prefill_left`` of them for prompt tokens,
    and ``reserve``, a token for each decode of the running list not yet reached."""

    def __init__(self, total: int, running: list[Request], config: SchedulerConfig, cost: StepCost | None = None,
                 floor: int = 16):
        """``cost``: the step-cost fit that ``config.target_step_ms`` reads; ``floor``: the fewest prompt tokens
        a target leaves a step."""
        self.total = self.tokens = total
        self.chunked = config.enable_chunked_prefill
        decodes = [r for r in running if is_decode(r)]
        self.reserve = len(decodes)
        self.decode_rows = self.decode_context = 0  # what the step has taken so far (its StepShape)
        # Without chunking a prompt cannot be split to fit a cap, so it would only wait.
        self.cap = None  # the step's prompt-token cap, None where nothing caps it
        if self.reserve and self.chunked:
            self.cap = min(config.max_prefill_tokens_with_decodes or total, total)
            if config.target_step_ms and cost is not None:
                self.cap = cost.prompt_tokens_within(config.target_step_ms / 1000, self.reserve,
                                                     sum(r.num_computed_tokens for r in decodes), floor, self.cap)
        self.prefill_left = total if self.cap is None else self.cap

    def reach(self, decode: bool) -> int:
        """The running list's next request is reached (``decode``: it is a decode row); what it may take."""
        self.reserve -= decode
        return self.tokens if decode else min(self.tokens - self.reserve, self.prefill_left)

    @property
    def for_waiting(self) -> int:
        """What a waiting request may take (its tokens are all prompt tokens)."""
        return min(self.tokens, self.prefill_left)

    def fit(self, n: int, limit: int) -> int:
        """``n`` wanted tokens cut to ``limit``; 0 without chunking when not all of them fit."""
        return 0 if not self.chunked and n > limit else min(n, limit)

    def take(self, n: int, decode: bool, context: int = 0) -> None:
        """``n`` tokens granted; ``context``: a decode row's KV tokens (what its attention reads)."""
        self.tokens -= n
        self.prefill_left -= 0 if decode else n
        self.decode_rows += decode
        self.decode_context += context if decode else 0

    @property
    def used(self) -> int:
        return self.total - self.tokens

    @property
    def shape(self) -> StepShape:
        """What the step holds so far, for the step-cost fit (a decode row's tokens are one each)."""
        return StepShape(self.decode_rows, self.decode_context, self.used - self.decode_rows)
