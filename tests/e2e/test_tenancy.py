"""Tenants on real workers: a prefill and a decode worker process (tiny model, CPU), a gateway, an
embedded Redis, and jobs XADDed the way the gateway queues them, with tenants, salts and arrival times
of our choosing (``jobs.py``). Fair admission serves a trickling tenant's requests ahead of another
tenant's flood that came first; per-tenant prefix caches never serve one tenant's KV to another; the workers'
Prometheus endpoints (``--monitoring-port``) move as requests flow and go back to idle; and every metric
the deploy/ alerts and dashboard use is one a live worker or gateway exposes."""

import random
import shutil
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.tenant_label import metrics_salt, tenant_hash
from tests.conftest import make_tiny_model
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.jobs import JobClient
from tests.unit.test_deploy import NVML_ONLY, check_names, exposed_names, referenced_metrics

pytestmark = pytest.mark.slow
MODEL = "tiny"
# 8192 blocks hold the whole flood's KV; the 1 GiB CPU default only costs start-up time here
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--served-model-name", MODEL,
          "--num-gpu-blocks-override", "8192"]
# A small prefill budget makes the flood a backlog of hundreds of scheduler steps; FCFS would put B behind it.
PREFILL = ["--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tenancy") / "tiny", seed=3)
    for f in smollm2_dir.iterdir():  # a real tokenizer, so the gateway can serve the model
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url, tmp_path_factory):
    c = Cluster(redis_url, str(model_dir), ENGINE, tmp_path_factory.mktemp("tenancy-logs"))
    c.redis.flushall()
    c.metrics_ports = {"p1": free_port(), "d1": free_port()}
    c.start_gateway()
    c.start_worker("prefill", "p1", ["--monitoring-port", str(c.metrics_ports["p1"]), *PREFILL])
    c.start_worker("decode", "d1", ["--monitoring-port", str(c.metrics_ports["d1"])])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def jobs(cluster):
    client = JobClient(cluster.redis, MODEL)
    yield client
    client.close()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def worker_metrics(cluster: Cluster, name: str) -> dict[tuple, float]:
    text = scrape(f"http://127.0.0.1:{cluster.metrics_ports[name]}/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(snap: dict[tuple, float], name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in snap.items() if n == name and want <= set(ls))


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def test_prefix_caches_are_never_shared_across_tenants(jobs):
    p = prompt(random.Random(7), 40)  # 4 full blocks of 8 can come from the cache

    def cached(rid: str, tenant: str, salt: str | None) -> int:
        jobs.submit(rid, p, tenant=tenant, cache_salt=salt, max_tokens=2)
        (seen,) = jobs.wait([rid])
        assert seen.finish_reason == "length"
        return seen.num_cached_tokens

    assert cached("salt-a1", "a", "salt-of-a") == 0
    assert cached("salt-a2", "a", "salt-of-a") == 32  # the same tenant hits its own prefix
    assert cached("salt-b1", "b", "salt-of-b") == 0
    # a gateway that handed B A's salt (or none at all) still cannot reach A's blocks: the tenant is
    # part of the cache namespace on the worker too
    assert cached("salt-b2", "b", "salt-of-a") == 0
    assert cached("salt-c1", "c", None) == 0


def test_flooding_tenant_does_not_starve_a_trickling_one(jobs):
    rng = random.Random(1)
    flood = [(f"flood-{i}", prompt(rng, 200), "a") for i in range(200)]
    jobs.submit_many(flood, max_tokens=2)
    trickle = []
    for i in range(5):  # one at a time, each once the last one is answered: a user who waits for replies
        jobs.submit(f"trickle-{i}", prompt(rng, 16), tenant="b", max_tokens=2)
        trickle += jobs.wait([f"trickle-{i}"], timeout=120)
    a = jobs.wait([rid for rid, _, _ in flood], timeout=600)
    # In one FCFS queue each of B's requests, queued after the whole flood, would get its first token after
    # every one of A's; admitted by tokens served, each goes ahead of most of A's backlog, however fast the
    # machine works through it.
    ahead_of = [sum(s.first > t.first for s in a) for t in trickle]
    print(f"\neach of B's requests got its first token before this many of A's {len(flood)}: {ahead_of}")
    assert all(n > len(flood) // 2 for n in ahead_of), ahead_of


def test_worker_metrics_move_and_settle(cluster, jobs):
    before = {n: worker_metrics(cluster, n) for n in ("p1", "d1")}
    rng = random.Random(3)
    rids = []
    for i in range(6):
        tenant = "metrics-a" if i % 2 else "metrics-b"
        jobs.submit(f"m-{i}", prompt(rng, 30), tenant=tenant, max_tokens=5)
        rids.append(f"m-{i}")
    jobs.wait(rids)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    client.completions.create(model=MODEL, prompt=[17, 42, 99, 7], max_tokens=3, temperature=0.0,
                              extra_body={"ignore_eos": True})

    def moved(name: str, worker: str, **labels) -> float:
        return total(after[worker], name, **labels) - total(before[worker], name, **labels)

    deadline = time.monotonic() + 60
    while True:  # gauges are read at scrape time: once the work is done they read zero again
        after = {n: worker_metrics(cluster, n) for n in ("p1", "d1")}
        gauges = [total(after[n], g) for n in after for g in ("vllm:num_requests_running",
                                                              "vllm:num_requests_waiting",
                                                              "vllm:kv_cache_usage_perc")]
        # the prefill worker frees a handoff's KV when it reads the ack, and counts the handoff only after
        # that poll has handled every ack it read: a scrape between the two sees the KV gone, the count not yet
        settled = not any(gauges) and moved("kvrelay_handoff_seconds_count", "p1") >= 7
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert gauges == [0.0] * 6

    p, d = "p1", "d1"
    assert moved("vllm:time_to_first_token_seconds_count", p) == 7
    assert moved("vllm:request_queue_time_seconds_count", p) == 7
    assert moved("vllm:prompt_tokens_total", p) >= 6 * 30
    assert moved("vllm:generation_tokens_total", p) == 7  # the first token of each
    assert moved("vllm:generation_tokens_total", d) == 6 * 4 + 2  # the rest
    assert moved("vllm:inter_token_latency_seconds_count", d) == 6 * 3 + 1
    assert moved("vllm:e2e_request_latency_seconds_count", d) == 7
    assert moved("vllm:request_success_total", d, finished_reason="length") == 7
    assert moved("vllm:prefix_cache_queries_total", p) >= 6 * 30
    assert moved("kvrelay_handoff_bytes_total", p) > 0 and moved("kvrelay_handoff_seconds_count", p) == 7
    assert moved("kvrelay_handoff_failures_total", p) == 0
    salt = metrics_salt(sync_client(cluster.redis_url))  # tenants show hashed: /metrics needs no key
    for w in (p, d):
        assert moved("kvrelay_worker_tenant_tokens_total", w, tenant=tenant_hash(salt, "metrics-a")) > 0
        assert moved("kvrelay_worker_tenant_tokens_total", w, tenant=tenant_hash(salt, "metrics-b")) > 0
        assert total(after[w], "process_resident_memory_bytes") > 0
        assert ("kvrelay_node_load1", ()) in after[w]
    assert total(after[p], "kvrelay_worker_info", role="prefill", model_name=MODEL) == 1


def test_deploy_references_only_live_metric_names(cluster):
    workers = scrape(f"http://127.0.0.1:{cluster.metrics_ports['p1']}/metrics") + \
        scrape(f"http://127.0.0.1:{cluster.metrics_ports['d1']}/metrics")
    try:
        gateway = exposed_names(scrape(f"http://127.0.0.1:{cluster.port}/metrics"))
    except urllib.error.HTTPError as exc:  # a gateway without its /metrics route yet
        assert exc.code == 404
        gateway = None
    live_workers = exposed_names(workers)
    referenced = referenced_metrics()
    print("\nreferenced by deploy/:", len(referenced), "names; not on the live workers:",
          sorted(referenced - live_workers))
    assert any(n.startswith("vllm:") for n in referenced & live_workers)
    # GPU series exist only on a worker that computes on a GPU with NVML; test_deploy checks those
    # names against the collector itself
    check_names(referenced - NVML_ONLY, live_workers, gateway)
