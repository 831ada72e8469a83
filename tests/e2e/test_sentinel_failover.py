"""Redis behind Sentinel: the master killed with -9 under steady streaming load. Real processes (a gateway
and a unified worker, ``--redis-url redis+sentinel://...`` with their least-privilege users), a real
master, replica and three sentinels on loopback (``tests/e2e/sentinel_redis.py``), real HTTP clients.

Measured and printed (run with -s): seconds from the kill until the sentinels name the promoted master and
until the first request succeeds again, and every request that failed (status, code), the lost jobs among
them. Asserted, with bounds that only catch a hang (a loaded 2-core box may take long over the failover):
every request is answered, a success or a clean error (503 with Retry-After, or an error event in its
stream); no process dies or hangs; serving resumes on the promoted master, with the tenant and API key every request
carries, the worker's registration, its model and its consumer group there, and no job left pending; none of the requests started after serving resumed fails; each request that
lost its job in the failover window was told so (503 ``queue_lost``), and the gateway's
``kvrelay_queued_jobs_lost_total`` counts as many jobs."""

import asyncio
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.load_records import Sample, until
from tests.e2e.sentinel_redis import SentinelRedis
from tests.e2e.sse_client import Outcome, post_json, stream_completion
from tests.integration.tenant_harness import ADMIN_KEY, Admin, bearer

pytestmark = pytest.mark.slow
CLIENTS = 8
RESUME_BOUND_S = 120.0  # a hang bound, not a speed claim: past it serving did not resume
# a hang bound too: a request waits for the failover at most (RESUME_BOUND_S), and is answered within this;
# one the gateway forgot would wait out its request timeout (600 s)
ANSWER_BOUND_S = 2 * RESUME_BOUND_S
# the gateway's --redis-outage-s: no failover that resumes serving at all outlasts it, so a job the promoted
# master holds is always waited for, never given up for lost
OUTAGE_S = RESUME_BOUND_S
PROBES = 4  # requests queued in the failover window, on the master alone
AFTER = 30  # successes after serving resumed before the load stops
CLEAN_CODES = {"queue_lost", "auth_unavailable", "queue_unavailable", "store_unavailable", "worker_lost", "no_worker"}


class Load:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.samples: list[Sample] = []
        self.stop = asyncio.Event()
        self.go = asyncio.Event()  # cleared: no client starts a request
        self.go.set()
        self.in_flight = 0

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": [5 + i % 50, 6, 7], "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        started = time.monotonic()
        self.in_flight += 1
        try:
            out = await asyncio.wait_for((stream_completion if i % 4 else post_json)(client, self.url, body),
                                         ANSWER_BOUND_S)
        except TimeoutError:
            out = Outcome(error=f"no answer within {ANSWER_BOUND_S} s")
        self.in_flight -= 1
        self.samples.append(Sample(started, time.monotonic(), out))
        if not out.ok:
            await asyncio.sleep(0.05)  # a client honouring Retry-After, shortened

    async def loop(self, client: httpx.AsyncClient, n: int) -> None:
        i = n
        while not self.stop.is_set():
            await self.go.wait()
            await self.one(client, i)
            i += CLIENTS

    def ok_since(self, t: float) -> int:
        return sum(1 for s in self.samples if s.started >= t and s.out.ok)


def _queued(ha: SentinelRedis, port: int) -> int:
    """Jobs in the model's job streams on the server at ``port`` (queued, or read and not yet acked)."""
    r = ha.data(port)
    return sum(r.xlen(s) for s in (keys.prefill_stream("tiny"), keys.prefill_worker_stream("tiny", "u1")))


def _cut_replication(ha: SentinelRedis, port: int) -> None:
    """The master keeps serving, but no replica receives its writes any more: the replication link is
    dropped and the replica's user switched off, so it cannot sync again. What is written from now on
    lives on the master alone, as writes do in the moment before a crash that replication has not caught."""
    r = ha.data(port)
    r.acl_setuser("replica", enabled=False)
    r.client_kill_filter(_type="slave")
    ha._wait(lambda: r.info("replication")["connected_slaves"] == 0, "the replica to disconnect")


def _replicated(ha: SentinelRedis, port: int) -> None:
    """Returns once the replica has everything the master at ``port`` was sent so far: it has acknowledged a
    write made after all of it (WAIT)."""
    r = ha.data(port)
    r.set("kvrelay-test:fence", 1)
    assert r.execute_command("WAIT", 1, int(RESUME_BOUND_S * 1000)) == 1, "the replica did not catch up"


async def _until_queued(ha: SentinelRedis, port: int, jobs: int, what: str) -> None:
    """Until exactly ``jobs`` jobs are in Redis at ``port``."""
    deadline = time.monotonic() + RESUME_BOUND_S
    while await asyncio.to_thread(_queued, ha, port) != jobs:
        assert time.monotonic() < deadline, f"{what} were not queued"
        await asyncio.sleep(0.02)


async def failover(ha: SentinelRedis, c: Cluster, port: int, key: str) -> dict:
    load = Load(port)
    async with httpx.AsyncClient(timeout=ANSWER_BOUND_S + 10, headers=bearer(key)) as client:
        tasks = [asyncio.create_task(load.loop(client, n)) for n in range(CLIENTS)]
        await until(lambda: load.ok_since(0) >= 3 * CLIENTS, 60, "steady load before the kill")
        old = ha.master_port()
        # The failover window, made certain: the worker frozen with no job in Redis, then one request of each
        # steady client queued (its job stays there: a job is acked when its request ends) and replicated, then
        # replication cut and PROBES requests queued on the master alone, then the kill.
        load.go.clear()
        await until(lambda: load.in_flight == 0, RESUME_BOUND_S, "the steady requests to end")
        await _until_queued(ha, old, 0, "no job left")
        c.signal("u1", signal.SIGSTOP)
        load.go.set()
        await _until_queued(ha, old, CLIENTS, "the steady clients' requests")
        await asyncio.to_thread(_replicated, ha, old)
        await asyncio.to_thread(_cut_replication, ha, old)
        probes = Load(port)
        probe_tasks = [asyncio.create_task(probes.one(client, 1000 + i)) for i in range(PROBES)]
        await _until_queued(ha, old, CLIENTS + PROBES, "the probes")
        killed = time.monotonic()
        await asyncio.to_thread(ha.kill_master)
        c.signal("u1", signal.SIGCONT)
        while (new := await asyncio.to_thread(ha.master_port)) in (old, None):
            assert time.monotonic() - killed < RESUME_BOUND_S, "no sentinel named a new master"
            await asyncio.sleep(0.05)
        promoted = time.monotonic()
        await until(lambda: any(s.ended >= promoted and s.out.ok for s in load.samples), RESUME_BOUND_S,
                     "a request answered after the promotion")
        resumed = min(s.ended for s in load.samples if s.ended >= promoted and s.out.ok)
        await until(lambda: load.ok_since(resumed) >= AFTER, RESUME_BOUND_S, f"{AFTER} requests after resuming")
        load.stop.set()
        await asyncio.gather(*tasks, *probe_tasks)
        metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    lost_metric = sum(s.value for f in text_string_to_metric_families(metrics) if f.name == "kvrelay_queued_jobs_lost"
                      for s in f.samples if s.name.endswith("_total"))
    return {"old": old, "new": new, "failover_s": promoted - killed, "resumed_s": resumed - killed,
            "samples": load.samples, "probes": probes.samples, "resumed": resumed, "lost_metric": lost_metric}


def test_master_killed_under_load_fails_over(tiny_model_dir, tmp_path):
    ha = SentinelRedis().start()
    c = Cluster(ha.url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    try:
        port = c.start_unified_as_roles(ha.role_url, ["--redis-outage-s", str(OUTAGE_S), "--admin-key", ADMIN_KEY])
        # every request carries a tenant's key made before the kill: the tenant and its key must survive
        _, key = Admin(f"http://127.0.0.1:{port}").tenant_with_key()
        pids = {name: proc.pid for name, proc in c.procs.items()}
        m = asyncio.run(failover(ha, c, port, key))
        samples: list[Sample] = m["samples"] + m["probes"]
        failed = [s for s in samples if not s.out.ok]
        lost = [s for s in failed if s.out.code == "queue_lost"]
        print(f"\n[sentinel failover] master {m['old']} killed -> {m['new']} promoted after {m['failover_s']:.2f} s, "
              f"first success {m['resumed_s']:.2f} s after the kill; {len(samples)} requests, {len(failed)} failed "
              f"{sorted({(s.out.status, s.out.code) for s in failed})}, {len(lost)} lost their job "
              f"(kvrelay_queued_jobs_lost_total {m['lost_metric']:g}); slowest answer "
              f"{max(s.ended - s.started for s in samples):.2f} s")
        assert m["new"] != m["old"]
        for s in failed:  # a clean, retryable error, never a hang or a dropped connection
            assert s.out.code in CLEAN_CODES, (s.out.status, s.out.code, s.out.error)
            assert s.out.status in (200, 503), (s.out.status, s.out.code, s.out.error)  # 200: an error event
            if s.out.status == 503:
                assert s.out.headers.get("retry-after"), s.out.headers
        after = [s for s in samples if s.started >= m["resumed"]]
        assert not [s for s in after if not s.out.ok], [s.out for s in after if not s.out.ok][:5]
        # exactly the jobs of the failover window were lost, each counted and its request told; the steady
        # clients' requests queued before it were replicated, and served after the failover
        assert [s.out.code for s in m["probes"]] == ["queue_lost"] * PROBES, [s.out for s in m["probes"]]
        assert len(lost) == PROBES and m["lost_metric"] == PROBES
        for name, proc in c.procs.items():
            assert proc.poll() is None and proc.pid == pids[name], f"{name} died:\n{c.log(name)[-3000:]}"
        # the promoted master has what the old one had: the registration, the model, the consumer group
        assert c.worker("u1")
        assert c.redis.exists(keys.model_key("tiny"))
        consumers = {x["name"] for x in c.redis.xinfo_consumers(keys.prefill_stream("tiny"), keys.PREFILL_GROUP)}
        assert b"u1" in consumers
        # nothing stuck: every job read before, during or after the failover was acked on the promoted master
        streams = (keys.prefill_stream("tiny"), keys.prefill_worker_stream("tiny", "u1"))
        deadline = time.monotonic() + RESUME_BOUND_S
        while (pending := [c.redis.xpending(s, keys.PREFILL_GROUP)["pending"] for s in streams]) != [0, 0]:
            assert time.monotonic() < deadline, f"jobs left pending: {pending}"
            time.sleep(0.1)
        for name in c.procs:
            text = c.log(name)
            assert "Traceback" not in text, f"{name} logged a traceback:\n{text[-3000:]}"
            assert text.count("redis unreachable:") <= 1, text[-3000:]
    finally:
        c.stop()
        ha.stop()
