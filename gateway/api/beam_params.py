"""What a ``use_beam_search`` request may ask for (the search: beam_search.py). Beam search scores with the
model's own log probabilities, so the sampling fields that would change them or the output (penalties,
filters, seeds, stop strings, prompt logprobs, ...) are a 400 naming the field, never ignored;
``temperature`` is accepted (vLLM takes it too) and has no effect on a deterministic search. ``logprobs``
(chat: ``top_logprobs``) up to the bound every request has; -1, the whole vocabulary, is a 400: a step
fetches a bounded list. Streamed, each choice comes whole once the search ends."""

from typing import Any

from kvrelay.gateway.errors import bad_request
from kvrelay.shared.wire.sampling_params import MAX_LOGPROBS, SamplingParams

# Request fields beam search cannot honour: one the request sets to other than its default is a 400 naming it
# (defaults a model's generation_config fills in do not count: the search never samples)
_UNUSED = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
           "stop_token_ids", "min_tokens", "ignore_eos", "prompt_logprobs",
           "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "echo", "suffix")


def check_beam_search(body: Any, params: SamplingParams, num_eos: int) -> None:
    """A 400 naming the field for what a beam search request (``body``, a completions or chat request) cannot
    do; ``params`` as prepared."""
    if params.logprobs == -1:
        raise bad_request(f"use_beam_search serves at most {MAX_LOGPROBS} logprobs per token, not the whole "
                          "vocabulary (-1)", "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs")
    for name in _UNUSED:
        if name in body.model_fields_set and _asks(getattr(body, name), type(body).model_fields[name].default):
            raise bad_request(f"{name} is not supported with use_beam_search (beam search ranks by the model's "
                              "own log probabilities)", name)
    keep = max(2, 1 + num_eos) * (params.beam_width or params.n)
    if keep > MAX_LOGPROBS:
        raise bad_request(f"a beam width of {params.beam_width} needs {keep} logprobs per step; at most "
                          f"{MAX_LOGPROBS} are supported", "best_of" if body.best_of else "n")


def _asks(value: Any, default: Any) -> bool:
    """Whether a field set to ``value`` asks for something (null, empty and the default ask for nothing; a
    bool is never a number: seed 0 asks, logprobs false does not)."""
    if value is None or value == [] or value == {}:
        return False
    return not (value == default and isinstance(value, bool) == isinstance(default, bool))
