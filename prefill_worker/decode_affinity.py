"""Which decode worker a prompt's KV went to last, so that the next handoff sharing its prefix (an n > 1
sibling, the next turn of a chat, a shared system prompt) goes there too: a decode worker reuses the prompt
blocks it holds and is sent only the rest (decode_worker/receiver.py), but only the one that holds them can.

Keyed by the block-hash chain the ask offers (HandoffRequest.block_hashes, each hash covering its whole
prefix), LRU-bounded: a guess of where the blocks are, as the gateway's PrefixIndex is of prefill caches. A
wrong guess costs a full transfer, never a wrong answer. Affinity yields to room and load: the remembered
worker is chosen only while it has the free blocks the prompt needs and its batch is within ``SLACK`` requests
of the least loaded candidate; otherwise the usual order (most free KV, then the lightest batch) decides.
"""

from collections import OrderedDict

SLACK = 8  # requests: how much busier than the least-loaded candidate the remembered worker may be
INDEX_MAX_BLOCKS = 128  # leading blocks a prompt is remembered by: a long shared document still matches
CAPACITY = 100_000  # (model, block hash) entries


class DecodeAffinity:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._where: OrderedDict[tuple[str, int], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def lookup(self, model: str, chain: list[int], live: set[str]) -> str | None:
        """The live decode worker the longest remembered prefix of ``chain`` went to, if any."""
        for h in reversed(chain[:INDEX_MAX_BLOCKS]):
            worker = self._where.get((model, h))
            if worker is not None and worker in live:
                return worker
        return None

    def record(self, model: str, chain: list[int], worker_id: str) -> None:
        for h in chain[:INDEX_MAX_BLOCKS]:
            self._where[(model, h)] = worker_id
            self._where.move_to_end((model, h))
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)
