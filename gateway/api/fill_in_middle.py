"""Completions' ``suffix``: fill in the middle, for models trained for it. The prompt is the prefix, the
suffix what follows the gap, and the model writes the middle, asked in the prefix-suffix-middle order code
models are trained on: ``<prefix marker> prompt <suffix marker> suffix <middle marker>``. The markers are
the tokenizer's own (StarCoder's ``<fim_prefix>``, Qwen2.5-Coder's ``<|fim_prefix|>``); a
model without them has not learnt the task, so a suffix there is a 400 rather than text it would misread."""

from kvrelay.gateway.api.tokenizer_pool import ModelTokenizer
from kvrelay.gateway.errors import bad_request

MARKER_SETS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
_FOUND: dict[int, tuple[int, int, int] | None] = {}  # id(ModelTokenizer) -> its markers' ids


def fim_markers(tokenizer: ModelTokenizer) -> tuple[int, int, int] | None:
    """The prefix, suffix and middle markers' token ids, or None when the tokenizer has no set."""
    key = id(tokenizer)
    if key not in _FOUND:  # the vocabulary is read once per loaded tokenizer
        vocab = tokenizer.hf.get_vocab()
        found = next((names for names in MARKER_SETS if all(n in vocab for n in names)), None)
        _FOUND[key] = tuple(vocab[n] for n in found) if found else None  # type: ignore[assignment]
    return _FOUND[key]


async def fill_in_middle(tokenizer: ModelTokenizer, prompt: str, suffix: str) -> list[int]:
    """The prompt's token ids for writing what goes between ``prompt`` and ``suffix``."""
    markers = fim_markers(tokenizer)
    if markers is None:
        raise bad_request("suffix needs a model trained to fill in the middle; this model's tokenizer has no "
                          "fill-in-the-middle tokens", "suffix")
    prefix_id, suffix_id, middle_id = markers
    # what the tokenizer puts before any text (a BOS), then the markers around the two parts
    lead = await tokenizer.encode("", add_special_tokens=True)
    return [*lead, prefix_id, *await tokenizer.encode(prompt, add_special_tokens=False), suffix_id,
            *await tokenizer.encode(suffix, add_special_tokens=False), middle_id]
