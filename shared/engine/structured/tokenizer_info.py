"""xgrammar's view of a tokenizer, with its special tokens marked as such.

xgrammar 0.2.9's ``TokenizerInfo.from_huggingface`` takes no special tokens: it counts as special only a token
whose text is empty (and ids past the vocabulary). SmolLM2's ``<|im_start|>``, ``<|endoftext|>``,
``<repo_name>`` ... have text, so it lists none, and inside a JSON string or a regex's ``[^"]*`` a control
token could be sampled as if it were its spelling. The tokenizer knows which they are (its added tokens
marked ``special``, and ``all_special_ids``): those are handed to xgrammar with empty text, which it then
never allows, except a stop token where the grammar may end (a request's own stop ids included: the matcher's
``override_stop_tokens`` allows a special id there too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar


def special_token_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer marks special: control tokens, not text."""
    ids = {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    return sorted(ids | set(tokenizer.all_special_ids))


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None) -> xgrammar.TokenizerInfo:
    """``from_huggingface``'s tokenizer info (its vocabulary type and prefix-space detection), rebuilt with
    the special tokens' text emptied (a 49k vocabulary: tens of milliseconds more, once per engine)."""
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            encoded[i] = token
    for i in special_token_ids(tokenizer):
        if 0 <= i < vocab_size:
            encoded[i] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, detected.dump_metadata())
