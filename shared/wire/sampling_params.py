"""Per-request sampling parameters (vLLM's names and defaults) and their validation.

Validation raises ``ValueError`` naming the offending field; the gateway maps it to a 400.
"""

from dataclasses import dataclass, field

from kvrelay.shared.wire.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS = 300  # entries per request, OpenAI's limit
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids per request: past any vocabulary, bounds a job's size
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, OpenAI's limit: -100 bans a token, +100 forces it


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0, OpenAI-style) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per sampled token (the sampled one is always returned)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int | None = None  # defaults to n
    length_penalty: float = 1.0
    # token id -> added to its logit before sampling (and before greedy's argmax); ids are checked
    # against the vocabulary where it is known (gateway, engine core), not here
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be sampled (every other logit is -inf); ids checked like logit_bias's
    allowed_token_ids: list[int] | None = None
    # the output must match this schema / regex / choice / grammar; the engine masks every other token
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None  # {} means no bias: one representation
        self.validate()

    def validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            fail("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            fail("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"must be -1 (disabled) or at least 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be non-negative, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # -1: the whole vocabulary (vLLM's); a server bounds who may ask for it (the gateway's --max-logprobs)
            if value is not None and (not isinstance(value, int) or not -1 <= value <= MAX_LOGPROBS):
                fail(name, f"must be in [0, {MAX_LOGPROBS}] or -1 (the whole vocabulary), got {value!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "entries must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "entries must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        if self.logit_bias is not None:
            self._validate_logit_bias(fail)
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, list) or not allowed:
                fail("allowed_token_ids", "must be a non-empty list of token ids (leave it out to allow every token)")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                fail("allowed_token_ids", f"may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed):
                fail("allowed_token_ids", "entries must be non-negative token ids")
        if self.use_beam_search:
            if self.logit_bias is not None:
                # beam search ranks beams by the raw logprobs the engine reports, so a bias would change
                # neither the candidates nor their scores: refused rather than silently ignored
                fail("logit_bias", "is not supported with use_beam_search")
            if self.allowed_token_ids is not None:
                fail("allowed_token_ids", "is not supported with use_beam_search")  # as logit_bias, above
            if self.structured_outputs is not None:
                fail("structured_outputs", "is not supported with use_beam_search")  # as logit_bias, above
            if self.beam_width is None:
                self.beam_width = self.n
            if self.beam_width < self.n:
                fail("beam_width", f"({self.beam_width}) must be at least n ({self.n})")
            if self.max_tokens is None:
                fail("max_tokens", "is required with use_beam_search")

    def _validate_logit_bias(self, fail) -> None:
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS:
            fail("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for token_id, value in bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                fail("logit_bias", f"keys must be non-negative token ids, got {token_id!r}")
            if not isinstance(value, int | float) or isinstance(value, bool) \
                    or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                fail("logit_bias", f"values must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                   f"got {value!r} for token {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
