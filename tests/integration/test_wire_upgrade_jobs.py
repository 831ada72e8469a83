"""A prefill worker's job queue of this version reading the jobs of a gateway of the next one, against a real
Redis: an extra field declared ignorable is dropped and the job runs; an unknown must-understand field (a
feature this worker cannot honour) dead-letters the job and tells its client why at once, never runs it."""

import msgpack
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import IGNORABLE_KEY, encode
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.job_queue_harness import MODEL, make_job, make_queue


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.flushall()
    return client


def _newer_job(rid: str, sampling: dict, ignorable: bool) -> bytes:
    raw = msgpack.unpackb(encode(make_job(rid)))
    raw["sampling"].update(sampling)
    if ignorable:
        raw["sampling"][IGNORABLE_KEY] = list(sampling)
    return msgpack.packb(raw, use_bin_type=True)


def test_a_newer_job_runs_without_its_ignorable_field_and_fails_loudly_on_a_must_understand_one(r):
    told = []
    q = make_queue(r, "w", idle_ms=60_000, on_dead=lambda rid, addr, why: told.append((rid, addr, why)))
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: _newer_job("hinted", {"cost_hint": 3}, ignorable=True)})
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: _newer_job("strict", {"dry_run": True}, ignorable=False)})
    got = q.fetch(5, block_ms=10)
    assert [(j.request_id, j.sampling) for _, j in got] == [("hinted", make_job("hinted").sampling)]
    (dead,) = r.xrange(keys.dead_letter_stream(MODEL))
    assert b"unknown field(s) dry_run that must be understood" in dead[1][b"reason"]
    (rid, addr, why), = told
    assert (rid, addr) == ("strict", make_job("strict").reply_addr)
    assert why.startswith("this worker cannot run the job: Job.sampling: unknown field(s) dry_run") and "newer" in why
