"""Results in vLLM's shape: ``RequestOutput.outputs[i].text / .token_ids / .logprobs / .finish_reason``."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated (or prompt) position: token id -> Logprob, the chosen token always included.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)  # one per running request per step: slots make it cheaper to build
class EngineCoreOutput:
    """What the engine core reports for one request after one step (token ids only; no text)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # set once, when the prompt is done
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # why an "error" finish happened (a constraint that does not compile)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
