"""Request bodies, with OpenAI's field names plus vLLM's sampling extras.

Every field a request may set either takes effect or is refused (tests/e2e/test_request_fields.py): an
unknown field is a 400 naming it, as OpenAI answers ("Unrecognized request argument supplied"), since a
misspelt ``temprature`` accepted and ignored hands the client something else than it asked for. Fields
OpenAI or vLLM define and kvrelay does not implement (UNSUPPORTED_FIELDS) are a 400 unless they ask for
nothing (``tools: []``, what some clients always send).
"""

import logging
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt

from kvrelay.gateway.api.output_constraints import (
    Constraint,
    ResponseFormat,
    StructuredOutputsRequest,
    request_constraint,
)
from kvrelay.gateway.api.tool_schemas import ToolDefinition
from kvrelay.gateway.bodies import validate
from kvrelay.gateway.errors import bad_request
from kvrelay.shared.wire.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, SamplingParams

log = logging.getLogger("kvrelay.gateway")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's; others are custom roles
INT64 = 2**63  # seeds and priorities travel as msgpack int64: larger ones must be refused, not crash
MAX_STOP_CHARS = 1024  # per stop string: the matcher holds back up to this much text on every token
# Upper bounds where SamplingParams has none, so 1e308 is a 400, not a request sampled at random. vLLM takes
# any temperature (OpenAI documents [0, 2]): clients moving from vLLM keep theirs, and past 100 every token
# is all but equally likely. vLLM bounds repetition_penalty only below; past 10 it only garbles text.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # a logit_bias key; ten digits cover any vocabulary
T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    # strict: no coercion, as OpenAI answers "expected a boolean" to stream="yes": "2" is not n=2, 1 is not
    # logprobs=true, true is not max_tokens=1, 5.0 is not an int. An int stays a float (temperature=1), as
    # JSON has one number type. Non-finite floats never get here (bodies.read_json names them); refused
    # here too for a body validated from elsewhere.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far; without include_usage no chunk carries any (as vLLM,
    # which accepts the pair rather than refusing it)
    continuous_usage_stats: bool = False

    def check(self) -> None:
        for name in sorted(self.model_extra or {}):
            raise bad_request(f"Unrecognized stream option: {name}", f"stream_options.{name}")


# Fields of OpenAI's or vLLM's request that kvrelay does not implement, each with the values that ask for
# nothing (what a client sends when it means "off"). Any other value would be ignored here and hand the
# client something else than it asked for, so it is a 400 naming the field, as is a name no API defines.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}


class _SamplingRequest(_Body):
    model: str | None = None  # None: the only registered model
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, le=MAX_TEMPERATURE)
    top_p: float = 1.0
    n: int = 1
    # vLLM's (and OpenAI's completions'): sample best_of, return the n most likely (best_of.py)
    best_of: int | None = None
    # vLLM's: the n best of a beam search as wide as best_of (else n), run over the workers (beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search's: a hypothesis scores sum_logprob / length ** length_penalty
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # OpenAI's fields that ask for nothing kvrelay would do differently; values that ask for something it does
    # not do (store: true, a paid tier) are refused in check_noop_fields
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes by itself
    safety_identifier: str | None = None
    # vLLM extras
    top_k: int = Field(default=-1, lt=INT64)  # past the vocabulary it is off; past int64 it cannot travel
    min_p: float = 0.0
    repetition_penalty: float = Field(default=1.0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    priority: int = Field(default=0, ge=-INT64, lt=INT64)
    cache_salt: str | None = Field(default=None, max_length=256)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's), for ids text loses
    # OpenAI's: token id (a string, as JSON keys are) -> bias; limits in SamplingParams, ids checked
    # against the model's vocabulary in prompts.py
    logit_bias: dict[str, Any] | None = None  # keys and values checked in _logit_bias, the 400 naming logit_bias
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's; ids checked against the vocabulary in prompts.py
    # What the output must match (OpenAI's and vLLM's names): one at most, mapped in output_constraints.py
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    _constraint_param: str | None = PrivateAttr(default=None)  # the field that set the constraint, once known
    guided_decoding_backend: str | None = None  # only "auto": one backend serves every request
    guided_whitespace_pattern: str | None = None  # refused when set: see output_constraints.py

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            noop = UNSUPPORTED_FIELDS.get(name)
            # true == 1 in Python: a bool only matches a bool
            if noop is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                            for v in noop):
                raise bad_request(f"{name} is not supported by this server", name)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")

    def check_noop_fields(self) -> None:
        if self.store:
            raise bad_request("store: true is not supported: this server keeps no completions", "store")
        if self.service_tier not in (None, "auto"):
            raise bad_request(f"service_tier {self.service_tier!r} is not supported (only 'auto')", "service_tier")
        if self.stream_options is not None:
            self.stream_options.check()

    @property
    def constraint_param(self) -> str | None:
        """The request field whose constraint the output follows (known once sampling_params ran)."""
        return self._constraint_param

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:  # before parsing every key of a huge map
            raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
                              "logit_bias")
        bias = {}
        for key, value in self.logit_bias.items():
            # the key is the token id in decimal, as OpenAI documents; int() would also take " 7", "+7", "7_0"
            if not _TOKEN_ID.fullmatch(key):
                raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias")
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise bad_request(f"logit_bias values must be numbers, got {value!r} for token {key}", "logit_bias")
            bias[int(key)] = value
        return bias

    def _best_of(self) -> int:
        """How many choices to sample per prompt: best_of, else n."""
        if self.best_of is None:
            return self.n
        if not 1 <= self.best_of <= MAX_N:
            raise bad_request(f"best_of must be in [1, {MAX_N}], got {self.best_of}", "best_of")
        if self.best_of < self.n:
            raise bad_request(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.stream and self.best_of > self.n and not self.use_beam_search:  # known only at the end
            raise bad_request("best_of greater than n cannot be streamed", "best_of")
        return self.best_of

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None = None, forced_call: Constraint | None = None) -> SamplingParams:
        """SamplingParams' own validation names the offending field; that becomes the 400's param."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad_request(f"stop strings may be at most {MAX_STOP_CHARS} characters long", "stop")
        logit_bias = self._logit_bias()
        constraint = request_constraint(self, forced_call)
        self._constraint_param = constraint.param if constraint else None
        if constraint is not None:
            # a complete document allows only its end: holding EOS back would leave nothing to sample (the
            # engine refuses the pair too; here it is a 400 before anything is queued). allowed_token_ids is
            # fine: the engine samples what both allow and ends a sequence where nothing is
            for name in ("min_tokens", "ignore_eos"):
                if getattr(self, name):
                    raise bad_request(f"{name} cannot be combined with an output constraint ({constraint.param})",
                                      name)
        fanout = self._best_of()
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise bad_request("length_penalty scores beam search: it needs use_beam_search", "length_penalty")
        if self.use_beam_search:  # beam_search.py returns n of the best_of beams
            beam_width: int | None = fanout
            fanout = self.n
        else:
            beam_width = None
            if fanout > self.n and logprobs is None:
                logprobs = 0  # the choices are ranked by their tokens' logprobs; shown only when asked for
        try:
            return SamplingParams(
                use_beam_search=self.use_beam_search, beam_width=beam_width, length_penalty=self.length_penalty,
                n=fanout, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, seed=self.seed,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids, structured_outputs=constraint.outputs if constraint else None,
            )
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param=message.split(" ", 1)[0]) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # text after the gap the model fills (fill_in_middle.py); "" asks for nothing

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            if not (isinstance(self.prompt, str) or all(isinstance(p, str) for p in self.prompt)):
                raise bad_request("suffix needs the prompt as text, not token ids", "suffix")
            if self.echo:
                raise bad_request("suffix and echo cannot be combined: the echoed prompt would not be the text "
                                  "before the answer", "suffix")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # the echoed prompt's tokens carry logprobs too: the worker computes them as prompt logprobs
            prompt_logprobs = -1 if -1 in (self.logprobs, prompt_logprobs) else max(self.logprobs, prompt_logprobs or 0)
        # OpenAI's and vLLM's completions default: 16 tokens.
        return self._sampling(16 if self.max_tokens is None else self.max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str | None:
        """Content as one string; text parts joined by newlines, as vLLM does."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"content part type {part.type!r} is not supported (text only)",
                                  f"messages.{index}.content.{j}.type")
            pieces.append(part.text)
        return "\n".join(pieces)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the final (assistant) message
    echo: bool = False  # vLLM's: the reply's content opens with the final (assistant) message it continues
    chat_template_kwargs: dict[str, Any] | None = None
    # Checked and planned in tool_schemas.plan_tools; a named choice is {"type": "function", ...}
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def sampling_params(self, remaining_context: int, forced_call: Constraint | None = None) -> SamplingParams:
        """``forced_call``: the output schema a tool_choice of "required" or a named function imposes."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        # checked here, not by SamplingParams, so the 400 names the chat field rather than the wire's "logprobs"
        if self.top_logprobs is not None and not -1 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}] or -1 (the whole vocabulary), got "
                              f"{self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # Chat default (vLLM): whatever context the prompt leaves.
        return self._sampling(remaining_context if requested is None else requested, logprobs,
                              forced_call=forced_call)

    def echoed(self) -> str:
        """What echo puts before the reply's text: the final (assistant) message's, else nothing."""
        return (self.messages[-1].text(len(self.messages) - 1) or "") if self.echo else ""

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template; role and emptiness checked."""
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            # both would open a new message after the final one and continue it (vLLM refuses the pair too)
            raise bad_request("continue_final_message requires add_generation_prompt to be false",
                              "continue_final_message")
        if self.chat_template_kwargs and "continue_final_message" in self.chat_template_kwargs:
            raise bad_request("continue_final_message is a request field, not a chat template argument",
                              "chat_template_kwargs")
        if self.echo and self.messages[-1].role != "assistant":
            # vLLM echoes nothing then; a field that asks for nothing it can do is a 400 here
            raise bad_request(f"echo repeats the final message when it is the assistant's; the final message is "
                              f"{self.messages[-1].role!r}", "echo")
        out = []
        for i, message in enumerate(self.messages):
            # a role outside OpenAI's (vLLM's custom roles) goes to the chat template, which decides: prompts.py
            # refuses one it fails on or leaves out
            if not message.role:
                raise bad_request("role must not be empty", f"messages.{i}.role")
            entry: dict[str, Any] = dict(message.model_extra or {})
            entry.update(role=message.role, content=message.text(i))
            if message.name is not None:
                entry["name"] = message.name
            out.append(entry)
        return out


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM)
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


def parse(model_cls: type[T], body: Any) -> T:
    """``validate``, then every field outside the schema refused: an unsupported one asking for something
    (``check_unsupported``) or any name no API defines. ``model`` may be left out (the only model the caller
    may use) but not null: OpenAI requires a string, and null is more likely a client's bug than a choice."""
    if isinstance(body, dict) and "model" in body and body["model"] is None:
        raise bad_request("model must be a string, not null (leave it out for the only model)", "model")
    parsed = validate(model_cls, body)
    if isinstance(parsed, _SamplingRequest):
        parsed.check_noop_fields()
        parsed.check_unsupported()
    for name in sorted(parsed.model_extra or {}):
        if not (isinstance(parsed, _SamplingRequest) and name in UNSUPPORTED_FIELDS):  # those: checked above
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    return parsed
