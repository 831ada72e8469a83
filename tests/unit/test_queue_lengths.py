"""The queue lengths a request reads before queueing its jobs, over a real Redis: the requests of a burst share
one read and see the jobs each other counted into it; a read after the burst is Redis's own again."""

import asyncio

import pytest

from kvrelay.gateway.queue_lengths import QueueLengths
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import async_client
from tests.integration.model_pool_harness import own_db

MODEL = "lengths-m"


class CountedPipelines:
    """The Redis client, counting the pipelines made from it."""

    def __init__(self, client):
        self._client = client
        self.pipelines = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def pipeline(self, **kwargs):
        self.pipelines += 1
        return self._client.pipeline(**kwargs)


@pytest.fixture()
async def client(redis_url):
    client = async_client(own_db(redis_url, 13))
    yield client
    await client.flushdb()
    await client.aclose()


async def test_a_burst_shares_one_read_and_counts_what_each_request_queues(client):
    shared = keys.prefill_stream(MODEL)
    for _ in range(3):
        await client.xadd(shared, {"j": b"x"})
    await client.xadd(keys.prefill_worker_stream(MODEL, "w1"), {"j": b"x"})
    counted = CountedPipelines(client)
    lengths = QueueLengths(counted)

    async def request(jobs_to_w2: int, jobs_shared: int) -> int:
        seen = await lengths.read(MODEL, [shared], ["w1", "w2"])
        depth = seen.depth
        seen.private["w2"] += jobs_to_w2  # what routing does with the jobs it sends a worker
        seen.shared += jobs_shared
        return depth

    first = asyncio.create_task(request(0, 0))  # its read goes out at once
    await asyncio.sleep(0)
    burst = await asyncio.gather(*(request(1, 1) for _ in range(5)))
    assert await first == 4
    assert counted.pipelines == 2  # the first request's read, and one for the five that came while it was out
    assert burst == [4, 6, 8, 10, 12]  # each sees what the requests before it in the burst counted
    again = await lengths.read(MODEL, [shared], ["w1", "w2"])
    assert (again.shared, again.private) == (3, {"w1": 1, "w2": 0})  # counted jobs never reached Redis here


async def test_other_workers_or_streams_are_read_apart(client):
    band = [keys.prefill_stream(MODEL)]
    lengths = QueueLengths(client)
    await client.xadd(keys.prefill_worker_stream(MODEL, "w3"), {"j": b"x"})
    one, two = await asyncio.gather(lengths.read(MODEL, band, ["w1"]), lengths.read(MODEL, band, ["w3"]))
    assert one is not two
    assert (one.private, two.private) == ({"w1": 0}, {"w3": 1})
