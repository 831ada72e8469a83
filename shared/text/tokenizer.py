"""Tokenizer loading and the set of token ids that end a generation.

No torch: transformers' ``AutoTokenizer`` imports it (its model-type lookup goes through the model
configuration code), and the gateway, which only tokenizes, would pay ~200 MB for it. A directory with a
``tokenizer.json`` holds the whole fast tokenizer (normalizer, pre-tokenizer, model, post-processor,
decoder; special tokens and chat template beside it), so it loads as that, without the model-specific
class ``AutoTokenizer`` would look up. Only a directory without one (a slow, SentencePiece-only
tokenizer) goes through ``AutoTokenizer``.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # workers need only eos_token_ids: importing transformers cost each ~1.4 s of CPU
    from transformers import PreTrainedTokenizerBase


# What a tokenizer is saved as: one of these beside the weights (a checkpoint with none serves token ids only).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> "PreTrainedTokenizerBase":
    from transformers import PreTrainedTokenizerFast

    # local only: our machines reach no hub, and a typo must not turn into a download attempt
    if (Path(path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    if not has_tokenizer(path):
        # said here: AutoTokenizer imports torch (its config lookup) and ~3 s of CPU later finds nothing
        raise FileNotFoundError(f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def eos_token_ids(tokenizer: "PreTrainedTokenizerBase | None", hf_config: dict,
                  model_dir: str | Path | None) -> list[int]:
    """Every id that ends generation, most authoritative first, without duplicates.

    generation_config.json wins (Llama-3-Instruct lists <|eot_id|> only there), then config.json,
    then the tokenizer's eos token (the only source for some converted checkpoints)."""
    ids: list[int] = []
    if model_dir is not None:
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            ids += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    ids += _as_ids(hf_config.get("eos_token_id"))
    if tokenizer is not None:
        ids += _as_ids(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))
