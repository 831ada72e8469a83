"""Compiling constraints off the step loop: one compile thread per engine, and an LRU of results keyed by
the constraint's text, so every request with the same schema after the first costs a dict lookup.

A compile returns a Future at once; the engine core keeps a request out of the scheduler until its future
is done (vLLM's WAITING_FOR_FSM), so a slow compile delays only the requests that wait for it. A failed
compile is cached too: the same bad schema fails again at once, with the same message. The backend itself
(the tokenizer's vocabulary, seconds to build) is made by the first compile, on the same thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvrelay.shared.engine.structured.backend import GrammarBackend
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

DEFAULT_CAPACITY = 512  # compiled grammars kept (a 10-field schema over a 49k vocabulary is tens of KB)


def constraint_key(so: StructuredOutputs) -> tuple:
    kind = so.kind
    if kind == "choice":
        return kind, tuple(so.choice)
    if kind == "json_object":
        return kind, ""
    return kind, getattr(so, kind)


class GrammarCache:
    def __init__(self, make_backend: Callable[[], GrammarBackend], capacity: int = DEFAULT_CAPACITY) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_error: Exception | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.capacity = capacity
        self.compiles = 0  # compiles started (tests check the cache is used)

    def submit(self, so: StructuredOutputs) -> Future:
        """The compiled grammar of ``so``, now or later. Called from the engine's thread only."""
        key = constraint_key(so)
        fut = self._compiled.get(key)
        if fut is not None:
            self._compiled.move_to_end(key)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.compiles += 1
        fut = self._compiled[key] = self._pool.submit(self._compile, so)
        while len(self._compiled) > self.capacity:  # requests hold their own futures: eviction is safe
            self._compiled.popitem(last=False)
        return fut

    def backend(self) -> GrammarBackend:
        """The backend (built by the first compile; only called for requests whose compile is done)."""
        if self._backend is None:
            raise RuntimeError("no grammar has been compiled yet")
        return self._backend

    def _compile(self, so: StructuredOutputs):
        if self._backend is None and self._backend_error is None:
            try:
                self._backend = self._make_backend()
            except Exception as exc:  # noqa: BLE001 - every request then gets this one reason
                self._backend_error = exc
        if self._backend_error is not None:
            raise ValueError(f"structured_outputs.{so.kind} cannot be served by this model: "
                             f"{self._backend_error}") from None
        return self._backend.compile(so)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._compiled.clear()
