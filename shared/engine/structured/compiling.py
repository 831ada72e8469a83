"""Requests whose structured-output constraint is still compiling: the engine core keeps them here, out of
the scheduler, until the compile is done (then they join it, or fail with the compile's message). One whose
prompt KV was computed elsewhere (``remote``) already holds its blocks and a decode seat while it waits."""

from collections.abc import Iterator
from concurrent import futures

from kvrelay.shared.engine.request import Request

IDLE_WAIT_S = 0.01  # with nothing else to run, how long a step waits for a compile instead of spinning


class CompilingRequests:
    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Request, bool]] = {}  # id -> (request, remote)

    def hold(self, req: Request, remote: bool) -> bool:
        """Keep ``req`` here if its constraint is still compiling; False when it can be scheduled now."""
        if req.grammar is None or req.grammar.ready:
            return False
        self._waiting[req.request_id] = (req, remote)
        return True

    def take_ready(self, idle: bool) -> list[tuple[Request, bool]]:
        """(request, remote) of each compile that finished, compiled or not, taken out; ``idle``: the
        engine has nothing else to run, so wait a little for one."""
        if not self._waiting:
            return []
        if idle:
            futures.wait([r.grammar.compiled for r, _ in self._waiting.values()], timeout=IDLE_WAIT_S,
                         return_when=futures.FIRST_COMPLETED)
        ready = [(rid, entry) for rid, entry in self._waiting.items() if entry[0].grammar.ready]
        for rid, _ in ready:
            del self._waiting[rid]
        return [entry for _, entry in ready]

    def drop(self, request_id: str) -> tuple[Request, bool] | None:
        """Take ``request_id`` out (aborted): (request, remote), or None if it is not waiting here."""
        return self._waiting.pop(request_id, None)

    def holds_seat(self, request_id: str) -> bool:
        entry = self._waiting.get(request_id)
        return entry is not None and entry[1]

    def requests(self) -> Iterator[Request]:
        return (req for req, _ in self._waiting.values())

    @property
    def num_remote(self) -> int:
        return sum(remote for _, remote in self._waiting.values())

    @property
    def num_local(self) -> int:
        return len(self._waiting) - self.num_remote

    def __bool__(self) -> bool:
        return bool(self._waiting)
