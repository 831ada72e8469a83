"""Completions' ``echo``: the prompt before each choice's text, and with ``logprobs`` the prompt tokens'
logprobs before the output's, in OpenAI's parallel-list shape (the first prompt token has none)."""

from kvrelay.gateway.api.logprobs import token_name
from kvrelay.gateway.api.prompts import Prepared
from kvrelay.gateway.api.schemas import CompletionRequest
from kvrelay.shared.wire.protocol import TopLogprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf (as for the output's logprobs)


def prompt_texts(body: CompletionRequest, prepared: Prepared) -> list[str]:
    """Each prompt as the client gave it; one given as token ids decoded (specials kept, as vLLM echoes)."""
    given = body.prompt
    if isinstance(given, str):
        return [given]
    if given and all(isinstance(p, str) for p in given):
        return list(given)
    return [prepared.tokenizer.decode(ids, skip_special_tokens=False) for ids in prepared.prompts]


def echo_logprobs(prepared: Prepared, prompt_ids: list[int], prompt_text: str,
                  entries: list[TopLogprobs | None] | None, output: dict, k: int, as_ids: bool) -> dict:
    """``output`` (completion_logprobs of the generated tokens, offsets from the output's start) with the
    prompt's tokens in front: their logprobs and best ``k`` from the worker's prompt logprobs, whose first
    entry is the prompt token itself. Offsets count in the echoed text, prompt_text + output."""
    text = prepared.tokenizer.token_text
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        tokens.append(token_name(token_id, text(token_id), as_ids))
        offsets.append(offset)
        offset += len(text(token_id))
        position = entries[i] if entries is not None and i < len(entries) else None
        if position is None:  # the first token: nothing predicts it
            logprobs.append(None)
            tops.append(None)
            continue
        (own_id, own_lp), alternatives = position[0], position[1:]
        logprobs.append(max(own_lp, _MIN_LOGPROB))
        # the prompt token first, as the sampled one is in the output's (vLLM's order)
        top = {token_name(own_id, text(own_id), as_ids): max(own_lp, _MIN_LOGPROB)}
        for t, lp in (alternatives if k < 0 else alternatives[:k]):
            top.setdefault(token_name(t, text(t), as_ids), max(lp, _MIN_LOGPROB))
        tops.append(top)
    return {
        "tokens": tokens + output["tokens"],
        "token_logprobs": logprobs + output["token_logprobs"],
        "top_logprobs": tops + output["top_logprobs"],
        "text_offset": offsets + [len(prompt_text) + o for o in output["text_offset"]],
    }
