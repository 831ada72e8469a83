"""One Redis round trip shared by every caller that asked for it while the previous one was in flight.

A burst of requests each asking Redis the same thing (is any tenant enforced, which models and workers are
up) or each adding to the same counters (usage) costs the event loop a round trip per request, ~0.1-0.2 ms of
Python each, on the path to the request's first token. Here the first caller's round trip is sent at once;
the callers that come while it is in flight wait for the next one, sent when it returns: at most one in
flight, so a burst costs one round trip per Redis reply instead of one per request.

Every caller gets a round trip sent after it asked, never one already on its way: a read is as fresh as
the caller's own would have been (a tenant created before the request arrived is enforced on it), and a
write carries everything its callers queued before they called (``usage.py``)."""
import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


class Coalesced(Generic[T]):
    def __init__(self, round_trip: Callable[[], Awaitable[T]]):
        self._round_trip = round_trip
        self._next: asyncio.Future[T] | None = None  # what the callers waiting now get: not sent yet
        self._driver: asyncio.Task | None = None

    async def __call__(self) -> T:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_retrieve)
            if self._driver is None:
                self._driver = asyncio.get_running_loop().create_task(self._drive())
        # shielded: one caller cancelled (its client gone) must not cancel what the others wait for
        return await asyncio.shield(self._next)

    async def _drive(self) -> None:
        try:
            while self._next is not None:
                waiting, self._next = self._next, None
                try:
                    result = await self._round_trip()
                except asyncio.CancelledError:
                    waiting.cancel()
                    raise
                except Exception as exc:
                    waiting.set_exception(exc)
                else:
                    waiting.set_result(result)
        finally:
            self._driver = None
            if self._next is not None:  # cancelled (the app stopping) with callers still waiting
                self._next.cancel()
                self._next = None


def _retrieve(future: asyncio.Future) -> None:
    """Marks a failed round trip's exception as seen: every caller may have gone before it came back."""
    if not future.cancelled():
        future.exception()


class CoalescedByKey(Generic[K, T]):
    """A ``Coalesced`` round trip per key (a model's streams, an API key): callers share only what they all
    asked for. Past ``max_keys`` keys (workers and keys come and go) the idle ones are forgotten; one in
    flight still answers those waiting for it."""

    def __init__(self, round_trip: Callable[[K], Awaitable[T]], max_keys: int = 256):
        self._round_trip = round_trip
        self._max_keys = max_keys
        self._by_key: dict[K, Coalesced[T]] = {}

    async def __call__(self, key: K) -> T:
        shared = self._by_key.get(key)
        if shared is None:
            if len(self._by_key) >= self._max_keys:
                self._by_key.clear()
            shared = self._by_key[key] = Coalesced(lambda: self._round_trip(key))
        return await shared()
