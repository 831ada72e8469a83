"""Callers that ask while a round trip is in flight share the next one, sent after they asked; one caller
cancelled leaves the others their answer; a failure reaches every caller waiting for it. Then the usage
ledger and the API key lookup over a real Redis: a burst of finished requests lands in a few pipelines, every
count intact; a tenant's burst looks its key up once, and a key revoked before a request is refused."""

import asyncio

import pytest

from kvrelay.gateway.coalesced import Coalesced
from kvrelay.gateway.tenancy.tenants import Tenant, TenantStore
from kvrelay.gateway.tenancy.usage import UsageLedger
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import async_client
from tests.integration.model_pool_harness import own_db


class Source:
    """A round trip that answers the number of the call, once ``release`` lets the call in flight return."""

    def __init__(self):
        self.sent = 0
        self.release = asyncio.Event()
        self.fail: Exception | None = None

    async def __call__(self) -> int:
        self.sent += 1
        number = self.sent
        await self.release.wait()
        self.release.clear()
        if self.fail is not None:
            raise self.fail
        return number


async def _let_run() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_callers_during_a_round_trip_share_the_next_one_sent_after_they_asked():
    source = Source()
    shared = Coalesced(source)
    first = asyncio.create_task(shared())
    await _let_run()
    assert source.sent == 1
    later = [asyncio.create_task(shared()) for _ in range(10)]
    await _let_run()
    assert source.sent == 1  # none of them rides the round trip already on its way
    source.release.set()
    assert await first == 1
    await _let_run()
    assert source.sent == 2
    source.release.set()
    assert await asyncio.gather(*later) == [2] * 10
    source.release.set()
    assert await shared() == 3  # idle again: a lone caller's round trip goes at once


async def test_a_cancelled_caller_leaves_the_others_their_answer():
    source = Source()
    shared = Coalesced(source)
    gone, staying = asyncio.create_task(shared()), asyncio.create_task(shared())
    await _let_run()
    gone.cancel()
    await _let_run()
    source.release.set()
    assert await staying == 1
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_a_failure_reaches_every_caller_waiting_for_it_and_the_next_round_trip_is_fresh():
    source = Source()
    shared = Coalesced(source)
    source.fail = ConnectionError("redis gone")
    waiting = [asyncio.create_task(shared()) for _ in range(3)]
    await _let_run()
    source.release.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    source.fail = None
    source.release.set()
    assert await shared() == 2


@pytest.fixture()
async def client(redis_url):
    client = async_client(own_db(redis_url, 14))
    yield client
    await client.flushdb()
    await client.aclose()


async def test_a_burst_of_finished_requests_lands_in_few_pipelines_with_every_count(client):
    ledger = UsageLedger(client, retention_s=3600)
    pipelines = 0
    write = ledger._write_pending

    async def counted() -> None:
        nonlocal pipelines
        pipelines += 1
        await write()

    ledger._write = Coalesced(counted)
    now = 1_800_000_000.0  # one minute for all, another for the last tenant's
    await asyncio.gather(*(ledger.record(f"t{i % 3}", "m", 10 + i, i, cache_hit=i % 5 == 0, now=now)
                           for i in range(60)),
                         ledger.record("t0", "other", 7, 0, now=now + 60))
    assert pipelines <= 3
    totals = {(u.tenant, u.model): u.as_dict() for u in await ledger.query(None, None, now, now + 60)}
    for t in range(3):
        mine = [i for i in range(60) if i % 3 == t]
        assert totals[(f"t{t}", "m")] == {
            "tenant": f"t{t}", "model": "m", "requests": len(mine), "prompt_tokens": sum(10 + i for i in mine),
            "completion_tokens": sum(mine), "total_tokens": sum(10 + 2 * i for i in mine),
            "cache_hits": sum(1 for i in mine if i % 5 == 0)}
    assert totals[("t0", "other")]["prompt_tokens"] == 7
    assert await client.ttl(keys.usage_key("t0", "other", int((now + 60) // 60))) > 3600


class CountedHgetall:
    """The Redis client, counting HGETALLs."""

    def __init__(self, client):
        self._client = client
        self.hgetalls = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def hgetall(self, name):
        self.hgetalls += 1
        return await self._client.hgetall(name)


async def test_a_tenants_burst_looks_its_key_up_once_and_a_revoked_key_is_refused_at_once(client):
    counted = CountedHgetall(client)
    store = TenantStore(counted)
    await store.put_tenant(Tenant(name="burst"))
    record, key = await store.issue_key("burst")
    _, other = await store.issue_key("burst")
    counted.hgetalls = 0
    found = await asyncio.gather(*(store.authenticate(k) for k in [key] * 20 + [other] * 5))
    assert [t.name for t in found] == ["burst"] * 25
    assert counted.hgetalls == 4  # per key: its record, then its tenant, once for the whole burst
    assert await store.revoke_key(record.id)
    assert await store.authenticate(key) is None  # asked after the revocation: a read sent after it
    assert (await store.authenticate(other)).name == "burst"
