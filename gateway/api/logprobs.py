"""Logprobs in the two OpenAI shapes (completions: parallel lists; chat: one object per token) and
vLLM's prompt_logprobs shape."""

from kvrelay.gateway.api.choice import TokenLogprob
from kvrelay.gateway.api.tokenizer_pool import ModelTokenizer
from kvrelay.shared.wire.protocol import TopLogprobs


def token_name(token_id: int, text: str, as_ids: bool) -> str:
    """A token as logprobs show it: its text, or vLLM's ``token_id:N`` (return_tokens_as_token_ids) for
    clients that need the id, which text does not give back (bytes split across tokens, specials)."""
    return f"token_id:{token_id}" if as_ids else text


def completion_logprobs(entries: list[TokenLogprob], as_ids: bool = False) -> dict:
    top = []
    for e in entries:
        # the sampled token always, and first (vLLM's order: clients read the first key as the token)
        alternatives = {token_name(e.token_id, e.token, as_ids): e.logprob}
        for tid, text, lp in e.top:
            alternatives.setdefault(token_name(tid, text, as_ids), lp)
        top.append(alternatives)
    return {
        "tokens": [token_name(e.token_id, e.token, as_ids) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": [e.text_offset for e in entries],
    }


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob], as_ids: bool = False) -> dict:
    content = []
    for e in entries:
        token = token_name(e.token_id, e.token, as_ids)
        top = [token_name(tid, text, as_ids) for tid, text, _ in e.top]
        content.append({"token": token, "logprob": e.logprob, "bytes": _utf8(token),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)}
                                         for t, (_, _, lp) in zip(top, e.top, strict=True)]})
    return {"content": content}


def prompt_logprobs(tokenizer: ModelTokenizer, entries: list[TopLogprobs | None] | None,
                    ranks: list[list[int] | None] | None) -> list | None:
    """Per prompt position (the first is None): the prompt token's own entry first with its true rank in
    the vocabulary, then the best tokens ranked 1..k (vLLM's shape). ``ranks`` is None from a worker that
    does not send them: every rank is then null rather than a guess."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for i, position in enumerate(entries):
        if position is None:
            out.append(None)
            continue
        position_ranks = ranks[i] if ranks is not None else None
        out.append({
            str(token_id): {"logprob": max(lp, -9999.0),
                            "rank": position_ranks[j] or None if position_ranks is not None else None,
                            "decoded_token": tokenizer.token_text(token_id)}
            for j, (token_id, lp) in enumerate(position)
        })
    return out
