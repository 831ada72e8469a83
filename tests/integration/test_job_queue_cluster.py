"""The job queue's tests (shared stream, private streams, adoption of a dead worker's, dead letters, moves
back to the shared stream, reclaiming, priority bands) run again on a real three-master Redis Cluster: every
MULTI, Lua script and several-stream XREADGROUP they drive touches one slot, an instance's. Collected here
with the ``r`` fixture below, which gives them a cluster client where their own modules give a single Redis."""

import pytest

from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration import test_job_queue, test_job_queue_priority, test_job_queue_private

for _module in (test_job_queue, test_job_queue_private, test_job_queue_priority):
    globals().update({name: test for name, test in vars(_module).items() if name.startswith("test_")})


@pytest.fixture()
def r(redis_cluster):
    client = sync_client(redis_cluster.url)
    client.flushall()  # every master
    yield client
    client.close()


@pytest.fixture()
def redis_url(redis_cluster):
    """Where a test makes clients of its own (the gateway's async one, for the queue gauges)."""
    return redis_cluster.url
