"""Whether one request can run on a model at all, checked before it enters the engine: a clear ValueError
naming the problem, never a request that fails later inside a step."""

import math

from kvrelay.shared.wire.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  block_size: int, capacity: int) -> int:
    """Raise ValueError naming what makes the n=1 request unservable; else return its max_tokens, capped to
    the room ``max_model_len`` leaves after the prompt. ``capacity``: the KV blocks the model can hold."""
    if params.n != 1 or params.use_beam_search:
        raise ValueError("the engine core takes n=1 requests; fan out n and beams above it")
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.allowed_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"allowed_token_ids token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if params.structured_outputs is not None and (params.min_tokens or params.ignore_eos):
        # a complete document allows only its end: holding EOS back would leave no token to sample
        raise ValueError(f"structured_outputs cannot be combined with "
                         f"{'min_tokens' if params.min_tokens else 'ignore_eos'}")
    n_prompt = len(prompt_token_ids)
    if n_prompt >= max_model_len:
        raise ValueError(
            f"prompt is {n_prompt} tokens long, but max_model_len is {max_model_len} "
            "(the prompt plus at least one generated token must fit)"
        )
    room = max_model_len - n_prompt
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    blocks_needed = math.ceil((n_prompt + max_tokens) / block_size)
    if blocks_needed > capacity:
        raise ValueError(
            f"prompt ({n_prompt}) plus max_tokens ({max_tokens}) needs {blocks_needed} KV blocks, "
            f"more than the cache holds ({capacity})"
        )
    return max_tokens
