"""Ids a worker remembers for a while: requests gateways aborted before they reached it, gateways found gone.

An abort is published once, to every worker (``AbortListener``); the request it names may still be a job in
its stream, a KV transfer on its way to a decode worker, or a reclaimed job coming back. A gateway found gone
(its liveness key lapsed) may still have jobs in the stream. Without a memory of them, such requests would be
computed to their last token for clients that are gone, holding seats and KV blocks all the while. Each role
asks where a request enters it (a job read from the stream, a handoff landing) and drops it there.

Bounded in time and count: a request whose abort was forgotten still ends at its deadline."""

import time
from collections import OrderedDict

# long enough for a job to wait out a busy queue or a handoff's retries; a deadline ends it after that
REMEMBER_S = 600.0
MAX_IDS = 100_000


class RecentIds:
    def __init__(self, remember_s: float = REMEMBER_S, max_ids: int = MAX_IDS):
        self.remember_s = remember_s
        self.max_ids = max_ids
        self._until: OrderedDict[str, float] = OrderedDict()  # request id -> monotonic expiry, oldest first

    def add(self, request_ids: list[str]) -> None:
        until = time.monotonic() + self.remember_s
        for rid in request_ids:
            self._until.pop(rid, None)
            self._until[rid] = until
        while len(self._until) > self.max_ids:
            self._until.popitem(last=False)

    def seen(self, request_id: str) -> bool:
        until = self._until.get(request_id)
        if until is None:
            return False
        if until < time.monotonic():
            del self._until[request_id]
            return False
        return True

    def forget(self, key: str) -> None:
        self._until.pop(key, None)

    def expire(self) -> None:
        now = time.monotonic()
        while self._until and next(iter(self._until.values())) < now:
            self._until.popitem(last=False)

    def __len__(self) -> int:
        return len(self._until)
