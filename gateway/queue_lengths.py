"""How many jobs wait in a model's streams, read for each request before its jobs are queued: what
``--max-queue-depth`` bounds and what the router balances workers by.

Workers delete the entries they acknowledge, so ``XLEN`` is what is queued or being prefilled, in the shared
stream (every priority band's) and in each live worker's private one. The requests of a burst that find the
same streams share one read (``coalesced.py``) and each adds the jobs it queues to the lengths they share, so
the next request of the burst counts them as its own read would have."""
from dataclasses import dataclass, field

import redis.asyncio
from aiohttp import web

from kvrelay.gateway.coalesced import CoalescedByKey
from kvrelay.shared.wire import redis_keys as keys


@dataclass
class Lengths:
    shared: int  # jobs in the model's shared stream (every band's)
    private: dict[str, int] = field(default_factory=dict)  # worker id -> jobs in its private stream

    @property
    def depth(self) -> int:
        return self.shared + sum(self.private.values())


class QueueLengths:
    def __init__(self, client: redis.asyncio.Redis):
        self._redis = client
        self._reads = CoalescedByKey(self._read)

    async def read(self, model: str, shared: list[str], worker_ids: list[str]) -> Lengths:
        """The lengths of ``shared`` (a model's shared streams) and of each worker's private stream for
        ``model``, shared with every request of the burst that asks the same (mutate them to count what
        you queue). Raises redis.RedisError."""
        return await self._reads((model, tuple(shared), tuple(worker_ids)))

    async def _read(self, key: tuple[str, tuple[str, ...], tuple[str, ...]]) -> Lengths:
        model, shared, worker_ids = key
        pipe = self._redis.pipeline(transaction=False)
        for stream in shared + tuple(keys.prefill_worker_stream(model, w) for w in worker_ids):
            pipe.xlen(stream)
        lengths = await pipe.execute()
        return Lengths(sum(lengths[:len(shared)]), dict(zip(worker_ids, lengths[len(shared):], strict=True)))


QUEUE_LENGTHS = web.AppKey("queue_lengths", QueueLengths)
