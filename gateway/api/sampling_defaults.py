"""What a request leaves out, filled in per model: the sampling defaults the model ships in its
``generation_config.json`` (vLLM's ``--generation-config auto``; ``vllm`` ignores the file and keeps
vLLM's own defaults), and a bound on the completion a chat request that names no ``max_tokens`` gets.

vLLM gives such a request the rest of the context, which a small model sampled at temperature 1 fills:
SmolLM2-135M rambled toward its 8,192 tokens at ~15 tokens/s on two cores, holding a batch slot for
minutes while the client's timeout expired. Here it gets the model's ``max_new_tokens`` or
``--max-tokens-default``, whichever is lower, and never more than the context left.
"""

import functools
import json
import logging
from pathlib import Path
from typing import Any

from kvrelay.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.wire.protocol import ModelInfo

log = logging.getLogger("kvrelay.gateway")

# generation_config.json's name -> the request field it is the default of (vLLM's list)
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@functools.lru_cache(maxsize=256)
def generation_defaults(model_dir: str) -> dict[str, Any]:
    """The request defaults ``model_dir/generation_config.json`` sets; {} without one. A path names one
    version of one model, so it is read once."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    return {field: raw[key] for key, field in GENERATION_FIELDS.items()
            if isinstance(raw, dict) and isinstance(raw.get(key), int | float) and not isinstance(raw[key], bool)}


def model_defaults(model: ModelInfo, config: GatewayConfig) -> dict[str, Any]:
    return generation_defaults(model.path) if config.generation_config == "auto" and model.path else {}


def apply_defaults(body: CompletionRequest | ChatCompletionRequest, model: ModelInfo,
                   config: GatewayConfig) -> dict[str, float | int]:
    """Sets, on the request itself, each sampling field it left out and the model has a default for (so
    the response cache and everything downstream see the values used); returns those fields, whose names
    are SamplingParams' too."""
    applied = {}
    for field, value in model_defaults(model, config).items():
        if field != "max_tokens" and field not in body.model_fields_set:
            setattr(body, field, value)
            applied[field] = value
    return applied


def default_chat_max_tokens(model: ModelInfo, config: GatewayConfig, remaining_context: int) -> int:
    """A chat request's ``max_tokens`` when it names none."""
    caps = [c for c in (model_defaults(model, config).get("max_tokens"), config.max_tokens_default) if c]
    return min([*caps, remaining_context])
