"""Per-model tokenizers, loaded lazily from ``ModelInfo.path`` and cached for the gateway's lifetime.

Loading and long encodes run in a thread: a tokenizer load takes long enough to stall every stream.
"""

import asyncio
import functools
from typing import Any

from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire.protocol import ModelInfo

# Below this many characters encoding inline is cheaper than a hop to a thread.
_INLINE_CHARS = 2048


class ModelTokenizer:
    """A loaded tokenizer plus what the gateway asks of it often (single-token strings, cached)."""

    def __init__(self, tokenizer: Any, model: ModelInfo):
        self.hf = tokenizer
        self.model = model
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        # Special tokens shown as themselves in logprobs, like vLLM.
        return self.hf.decode([token_id], skip_special_tokens=False)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= _INLINE_CHARS:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.hf.encode, text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          template_kwargs: dict | None) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise bad_request(f"model {self.model.name!r} has no chat template; use /v1/completions", "messages")
        try:
            return await asyncio.to_thread(self.hf.apply_chat_template, messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **(template_kwargs or {}))
        except Exception as exc:  # jinja raises TemplateError, templates raise on bad role orders, ...
            raise bad_request(f"chat template failed: {exc}", "messages") from None


class TokenizerPool:
    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str], ModelTokenizer] = {}
        self._loading: dict[tuple[str, str], asyncio.Task] = {}

    async def get(self, model: ModelInfo) -> ModelTokenizer:
        # Keyed by path as well: a model re-registered at a new version gets its new tokenizer.
        key = (model.name, model.path)
        if key in self._loaded:
            return self._loaded[key]
        task = self._loading.get(key)
        if task is None:  # one load per key, however many requests arrive while it runs
            task = asyncio.create_task(asyncio.to_thread(load_tokenizer, model.path))
            self._loading[key] = task
        try:
            tokenizer = await asyncio.shield(task)
        except Exception as exc:
            raise APIError(500, f"cannot load the tokenizer of {model.name!r}: {exc}",
                           code="tokenizer_unavailable") from None
        finally:
            if task.done():
                self._loading.pop(key, None)
        loaded = self._loaded.setdefault(key, ModelTokenizer(tokenizer, model))
        return loaded
