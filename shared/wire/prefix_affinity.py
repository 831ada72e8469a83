"""Where this process last sent each prompt prefix: (model, block hash) -> worker id, LRU-bounded. The gateway
keeps one to send a prompt to the prefill worker whose prefix cache likely holds its leading blocks
(gateway/control/routing.py); a prefill worker keeps one to hand a prompt's KV to the decode worker that likely
holds them (prefill_worker/handoff.py). Either is a guess of another process's cache (it evicts, other senders
send too), as SGLang's router keeps: a wrong guess costs a cache miss or a full transfer, never a wrong answer.

Its keys are the block-hash chains of block_hash.py, each hash covering its whole prefix, so a prompt matches
every prefix of another recorded whole; it lives beside them in wire, the layer the gateway and the workers
both import. How many leading blocks a chain has is its caller's choice (the gateway hashes only as many as it
routes by).
"""

from collections import OrderedDict

# leading blocks a prompt is remembered by: a long shared document still matches, and hashing them is cheap
MAX_PREFIX_BLOCKS = 128


class PrefixAffinity:
    def __init__(self, capacity: int):
        """``capacity``: (model, block hash) entries kept; the least recently recorded goes first."""
        self.capacity = capacity
        self._where: OrderedDict[tuple[str, int], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def lookup(self, model: str, chain: list[int], live: set[str]) -> str | None:
        """The worker in ``live`` that the longest recorded prefix of ``chain`` went to, if any. A departed
        worker's entries are skipped here, not forgotten: they age out as others are recorded."""
        for h in reversed(chain):
            worker = self._where.get((model, h))
            if worker is not None and worker in live:
                return worker
        return None

    def record(self, model: str, chain: list[int], worker: str) -> None:
        """Every prefix of ``chain`` went to ``worker`` (looking up does not count as use)."""
        for h in chain:
            self._where[(model, h)] = worker
            self._where.move_to_end((model, h))
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)
