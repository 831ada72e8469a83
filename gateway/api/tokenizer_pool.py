"""Per-model tokenizers, loaded lazily from ``ModelInfo.path`` and cached for the gateway's lifetime.

Loading, long encodes and chat templates run on a few tokenization threads: they take long enough to
stall every stream if run on the event loop. A Hugging Face fast tokenizer is one Rust object whose
settings (truncation, padding, special-token splitting) transformers sets as state before an encode;
shared between threads, a setting made for one call reaches another thread's encode in flight (a long
prompt cut to another call's max_length) or fails it ("RuntimeError: Already borrowed"). So no tokenizer
is used by two threads: the event loop keeps one (detokenizing streams, short encodes, single-token
strings) and each tokenization thread takes its own on first use, all loaded together by one thread (a
load on each thread puts its allocations in that thread's own malloc arena, ~4x the memory). One per
thread rather than one tokenizer under a lock: the lock holds the loop's decodes behind long encodes
(BENCHMARKS.md, "Gateway tokenization threads").
"""

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

# Imported up front, on the main thread: left to the first tokenizer load, on a tokenization thread, the
# import holds the GIL for seconds while requests are served, and the event loop starves (Redis lookups
# time out). Workers, which tokenize nothing, skip it.
from transformers import PreTrainedTokenizerFast  # noqa: F401

from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire.protocol import ModelInfo

log = logging.getLogger("kvrelay.gateway")
T = TypeVar("T")
# Below this many characters encoding inline is cheaper than a hop to a thread.
_INLINE_CHARS = 2048
# Each holds its own copy of every model's tokenizer. The threads and the event loop share the cores and
# the GIL, so more threads than half the cores only add loop lag (BENCHMARKS.md); at most 4 bounds the
# copies on big hosts.
TOKENIZER_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class ModelTokenizer:
    """A loaded tokenizer plus what the gateway asks of it often (single-token strings, cached)."""

    def __init__(self, tokenizers: list[Any], model: ModelInfo, executor: ThreadPoolExecutor):
        """``tokenizers``: the event loop's, then one for each thread of ``executor``."""
        self.hf = tokenizers[0]  # the event loop's: never used from another thread
        self._spares = tokenizers[1:]
        self.model = model
        self._executor = executor
        self._per_thread = threading.local()
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self._renders_tools: bool | None = None

    def _token_text(self, token_id: int) -> str:
        # Special tokens shown as themselves in logprobs, like vLLM.
        return self.hf.decode([token_id], skip_special_tokens=False)

    def _thread_tokenizer(self) -> Any:
        """The calling tokenization thread's own tokenizer."""
        tokenizer = getattr(self._per_thread, "hf", None)
        if tokenizer is None:
            tokenizer = self._per_thread.hf = self._spares.pop()  # atomic: threads never get the same one
        return tokenizer

    async def _in_thread(self, fn: Callable[[Any], T]) -> T:
        """``fn`` of the tokenizer of whichever tokenization thread runs it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(self._thread_tokenizer()))

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= _INLINE_CHARS:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        return await self._in_thread(lambda hf: hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise bad_request(f"model {self.model.name!r} has no chat template; use /v1/completions", "messages")
        try:
            return await self._in_thread(lambda hf: hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {})))
        except Exception as exc:  # jinja raises TemplateError, templates raise on bad role orders, ...
            raise bad_request(f"chat template failed: {exc}", "messages") from None

    async def renders_tools(self) -> bool:
        """Whether the chat template offers tools to the model: one that ignores ``tools=`` would have the
        model answer without knowing them (and write no calls to parse). Probed once per model."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                     "parameters": {"type": "object", "properties": {}}}}
            try:
                with_tools = await self.render_chat(probe, True, None, [tool])
                self._renders_tools = with_tools != await self.render_chat(probe, True, None)
            except APIError:  # a template that fails on a plain question fails every request anyway
                self._renders_tools = False
        return self._renders_tools


class TokenizerPool:
    def __init__(self, threads: int | None = None) -> None:
        self._loaded: dict[tuple[str, str], ModelTokenizer] = {}
        self._loading: dict[tuple[str, str], asyncio.Task] = {}
        self._failed: set[tuple[str, str]] = set()  # prefetches that failed: not retried by prefetch
        self._threads = threads or TOKENIZER_THREADS
        self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="tokenize")

    def _load(self, path: str) -> list[Any]:
        return [load_tokenizer(path) for _ in range(1 + self._threads)]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start(self, key: tuple[str, str]) -> asyncio.Task:
        task = self._loading.get(key)
        if task is None:  # one load per key, however many requests arrive while it runs
            task = asyncio.create_task(asyncio.to_thread(self._load, key[1]))
            self._loading[key] = task
        return task

    def prefetch(self, model: ModelInfo) -> bool:
        """Whether ``model``'s tokenizers are ready; if not, start loading them in the background. A
        load that failed counts as ready and is not retried here (a request retries it through get(),
        and gets its error): readiness must neither wait on a tokenizer that will never load nor flap."""
        key = (model.name, model.path)
        if key in self._loaded or key in self._failed:
            return True
        task = self._start(key)
        if not task.done():
            return False
        self._loading.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            self._failed.add(key)
            log.warning("tokenizer of %r did not load: %s", model.name,
                        "cancelled" if task.cancelled() else task.exception())
        else:
            self._loaded.setdefault(key, ModelTokenizer(task.result(), model, self._executor))
        return True

    async def get(self, model: ModelInfo) -> ModelTokenizer:
        # Keyed by path as well: a model re-registered at a new version gets its new tokenizer.
        key = (model.name, model.path)
        if key in self._loaded:
            return self._loaded[key]
        task = self._start(key)
        try:
            tokenizers = await asyncio.shield(task)
        except Exception as exc:
            raise APIError(500, f"cannot load the tokenizer of {model.name!r}: {exc}",
                           code="tokenizer_unavailable") from None
        finally:
            if task.done():
                self._loading.pop(key, None)
        loaded = self._loaded.setdefault(key, ModelTokenizer(tokenizers, model, self._executor))
        return loaded


TOKENIZERS = web.AppKey("tokenizers", TokenizerPool)
