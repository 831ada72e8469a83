"""WorkerMetrics driven by a real scheduler and the fake runner of test_scheduler, read back through the
Prometheus text format: which role records what, gauges that follow the scheduler back to zero, finish
reasons, per-tenant tokens, handoffs, and the NVML collector against a stand-in NVML."""

import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.shared.config.engine import CacheConfig, SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.engine_stats import ITERATION_TOKENS_BUCKETS, RELAYED_HISTOGRAMS, REQUEST_LATENCY_BUCKETS
from kvrelay.shared.wire.protocol import InstanceStatus
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.host_stats import HostCollector
from kvrelay.shared.worker.metrics import WorkerMetrics
from kvrelay.shared.worker.metrics_server import MergedMetrics
from tests.unit.scheduler_runner import BS, FakeRunner


def samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(snap, name, **labels) -> float:
    return snap.get((name, tuple(sorted(labels.items()))), 0.0)


class Engine:
    """An EngineCore's surface as WorkerMetrics reads it, over a real scheduler and block manager, and how
    EngineCore reports a step to it."""

    def __init__(self, role: str, hold: bool = False):
        self.block_manager = BlockManager(64, BS)
        self.config = SimpleNamespace(cache=CacheConfig(block_size=BS), tensor_parallel_size=1, pipeline_parallel_size=1)
        self.block_size, self.dtype, self.kv_dtype, self.num_total_blocks = BS, "float32", "float32", 64
        self.resident_overhead_bytes, self.step_peak_bytes = 0, 0  # what a loaded engine measured (none here)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), self.block_manager, 64,
                                   hold_finished_kv=hold)
        self.metrics = WorkerMetrics(self, "tiny", role, "w1")
        self.runner = FakeRunner(self.scheduler)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.block_manager.prefix_queries, self.block_manager.prefix_hits

    def prompt_budget(self) -> tuple[int | None, None]:
        return self.scheduler.last_prefill_cap, None  # no --target-step-ms here

    def step(self) -> list[Request]:
        started = time.time()
        out, finished = self.runner.step()
        self.metrics.on_step(started, out, finished)
        return finished


def req(rid: str, tenant: str, n_prompt: int = 10, max_tokens: int = 3, age: float = 1.0) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(), eos_token_id=2, max_tokens=max_tokens,
                   tenant=tenant, arrival_wall=time.time() - age)


def test_prefill_role_records_queue_ttft_and_prompt_tokens():
    e = Engine("prefill", hold=True)
    m = "tiny"
    for i, tenant in enumerate(["a", "a", "b"]):
        r = req(f"r{i}", tenant, max_tokens=1)  # a prefill worker stops every request at its first token
        e.scheduler.add_request(r)
    snap = samples(e.metrics.registry)
    assert value(snap, "vllm:num_requests_waiting", model_name=m) == 3
    done = []
    while e.scheduler.has_unfinished():
        done += e.step()
    snap = samples(e.metrics.registry)
    assert value(snap, "vllm:time_to_first_token_seconds_count", model_name=m) == 3
    assert value(snap, "vllm:time_to_first_token_seconds_bucket", model_name=m, le="0.75") == 0  # arrived 1 s ago
    assert value(snap, "vllm:request_queue_time_seconds_count", model_name=m) == 3
    assert value(snap, "vllm:prompt_tokens_total", model_name=m) == 30
    assert value(snap, "vllm:generation_tokens_total", model_name=m) == 3
    # r1 repeats r0's prompt: its first 8 tokens come from the prefix cache and are not computed again;
    # b's equal prompt is another tenant's, so it misses
    assert value(snap, "kvrelay_worker_tenant_tokens_total", model_name=m, tenant="a") == 10 + 2
    assert value(snap, "kvrelay_worker_tenant_tokens_total", model_name=m, tenant="b") == 10
    assert value(snap, "vllm:prefix_cache_queries_total", model_name=m) == 30
    assert value(snap, "vllm:prefix_cache_hits_total", model_name=m) == 8
    # the engine "finished" them at the prefill cap; only the worker knows whether they really ended
    assert not any(k[0] == "vllm:request_success_total" for k in snap)
    assert value(snap, "vllm:kv_cache_usage_perc", model_name=m) > 0  # KV held for the handoff
    e.metrics.request_done("stop", done[0].arrival_wall)
    e.metrics.handoff_done(4096, 0.002, ok=True)
    e.metrics.handoff_done(0, 1.0, ok=False)
    e.metrics.handoff_done(4096, 3.5, ok=True, seat_wait_s=3.0)  # waited for a decode seat, then landed
    e.metrics.seat_waiting = lambda: 5  # as a prefill worker's handoffs report it
    for r in done:
        e.scheduler.release_held(r.request_id)
    snap = samples(e.metrics.registry)
    assert value(snap, "vllm:request_success_total", model_name=m, finished_reason="stop") == 1
    assert value(snap, "vllm:e2e_request_latency_seconds_count", model_name=m) == 1
    assert value(snap, "kvrelay_handoff_bytes_total", model_name=m) == 8192
    assert value(snap, "kvrelay_handoff_seconds_count", model_name=m) == 2
    assert value(snap, "kvrelay_handoff_seat_wait_seconds_count", model_name=m) == 1  # only the one that waited
    assert value(snap, "kvrelay_handoff_seat_wait_seconds_sum", model_name=m) == 3.0
    assert value(snap, "kvrelay_handoff_waiting_for_seat", model_name=m) == 5
    assert value(snap, "kvrelay_handoff_failures_total", model_name=m) == 1
    assert value(snap, "vllm:kv_cache_usage_perc", model_name=m) == 0
    assert value(snap, "vllm:num_requests_running", model_name=m) == 0
    assert value(snap, "vllm:num_requests_waiting", model_name=m) == 0


def test_decode_role_records_itl_e2e_and_finish_reasons():
    e = Engine("decode")
    m = "tiny"
    for i in range(2):
        r = req(f"d{i}", "a", n_prompt=8, max_tokens=4)
        blocks = e.block_manager.allocate_for_tokens(r.request_id, 8)
        for p in range(8):  # the KV a prefill worker would have sent, in the fake runner's slot format
            e.runner.dev[blocks[p // BS]][p % BS] = (None, tuple(r.prompt_token_ids[: p + 1]))
        r.output_token_ids, r.num_computed_tokens = [5], 8  # KV and first token came from a prefill worker
        e.scheduler.add_prefilled_request(r)
    aborted = req("gone", "b", n_prompt=8)
    e.scheduler.add_request(aborted)
    assert value(samples(e.metrics.registry), "vllm:num_requests_running", model_name=m) == 2
    e.metrics.on_removed([e.scheduler.abort_request("gone")])
    while e.scheduler.has_unfinished():
        e.step()
    snap = samples(e.metrics.registry)
    assert value(snap, "vllm:time_to_first_token_seconds_count", model_name=m) == 0  # the prefill side's
    assert value(snap, "vllm:prompt_tokens_total", model_name=m) == 0
    assert value(snap, "vllm:generation_tokens_total", model_name=m) == 6  # tokens 2..4 of each
    assert value(snap, "vllm:inter_token_latency_seconds_count", model_name=m) == 4  # gaps between them
    assert value(snap, "vllm:e2e_request_latency_seconds_count", model_name=m) == 2
    assert value(snap, "vllm:e2e_request_latency_seconds_bucket", model_name=m, le="0.8") == 0
    assert value(snap, "vllm:request_success_total", model_name=m, finished_reason="length") == 2
    assert value(snap, "vllm:request_success_total", model_name=m, finished_reason="abort") == 1
    assert value(snap, "vllm:num_requests_running", model_name=m) == 0


def test_decode_role_counts_quota_waits_and_the_most_a_tenant_held_at_a_grant():
    e = Engine("decode")
    quota = e.metrics.quota
    for tenant in ("a", "a", "b"):
        quota.waited(tenant)
    for tenant, held in (("a", 5), ("a", 3), ("b", 2)):
        quota.granted(tenant, held)
    e.metrics.quota_waiting = lambda: 4  # as a decode worker's line reports it
    snap = samples(e.metrics.registry)
    for tenant, waits, peak in (("a", 2, 5), ("b", 1, 2)):
        assert value(snap, "kvrelay_handoff_quota_waits_total", model_name="tiny", tenant=tenant) == waits
        assert value(snap, "kvrelay_handoff_tenant_kv_blocks_peak", model_name="tiny", tenant=tenant) == peak
    assert value(snap, "kvrelay_handoff_waiting_for_quota", model_name="tiny") == 4
    assert Engine("prefill").metrics.quota is None  # a prefill worker shows only how many of its handoffs wait


def test_decode_role_counts_held_asks_by_outcome_from_zero_and_how_long_they_were_held():
    e = Engine("decode")
    snap = samples(e.metrics.registry)
    assert [snap.get(("kvrelay_handoff_held_asks_total", (("model_name", "tiny"), ("outcome", o))))
            for o in ("ready", "unblocked", "dropped")] == [0, 0, 0]  # present before any ask is held
    for outcome, held_s in (("ready", 0.02), ("ready", 0.004), ("unblocked", 2.5), ("dropped", 0.3)):
        e.metrics.held_asks.ended(outcome, held_s)
    snap = samples(e.metrics.registry)
    assert [value(snap, "kvrelay_handoff_held_asks_total", model_name="tiny", outcome=o)
            for o in ("ready", "unblocked", "dropped")] == [2, 1, 1]
    assert value(snap, "kvrelay_handoff_held_ask_seconds_count", model_name="tiny") == 4
    assert value(snap, "kvrelay_handoff_held_ask_seconds_sum", model_name="tiny") == pytest.approx(2.824)
    assert value(snap, "kvrelay_handoff_held_ask_seconds_bucket", model_name="tiny", le="0.005") == 1
    assert Engine("prefill").metrics.held_asks is None and Engine("unified").metrics.held_asks is None


def test_unified_role_records_both_sides():
    e = Engine("unified")
    e.scheduler.add_request(req("u", "a", max_tokens=4))
    while e.scheduler.has_unfinished():
        e.step()
    snap = samples(e.metrics.registry)
    assert value(snap, "vllm:time_to_first_token_seconds_count", model_name="tiny") == 1
    assert value(snap, "vllm:inter_token_latency_seconds_count", model_name="tiny") == 3
    assert value(snap, "vllm:request_success_total", model_name="tiny", finished_reason="length") == 1
    assert value(snap, "kvrelay_worker_info", model_name="tiny", role="unified", worker_id="w1") == 1
    # the 10-token prompt in one chunk, then three one-token steps
    assert value(snap, "kvrelay_engine_steps_total", model_name="tiny", kind="prefill") == 1
    assert value(snap, "kvrelay_engine_steps_total", model_name="tiny", kind="decode") == 3
    assert value(snap, "kvrelay_engine_steps_total", model_name="tiny", kind="mixed") == 0
    assert value(snap, "process_resident_memory_bytes") > 0
    assert "kvrelay_node_load1" in {k[0] for k in snap}
    assert not any(k[0].startswith("kvrelay_gpu_") for k in snap)  # CPU worker: no GPU series


def test_unified_role_records_vllms_phases_and_step_sizes_and_the_heartbeat_carries_them():
    e = Engine("unified")
    e.scheduler.add_request(req("u", "a", max_tokens=4))
    while e.scheduler.has_unfinished():
        e.step()
    snap = samples(e.metrics.registry)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(snap, f"vllm:request_{phase}_time_seconds_count", model_name="tiny") == 1, phase
    # the 10-token prompt and the first token in one step, then three one-token steps (vLLM's count)
    assert value(snap, "vllm:iteration_tokens_total_count", model_name="tiny") == 4
    assert value(snap, "vllm:iteration_tokens_total_sum", model_name="tiny") == 14
    assert value(snap, "vllm:iteration_tokens_total_bucket", model_name="tiny", le="8.0") == 3
    assert value(snap, "vllm:cache_config_info", model_name="tiny", block_size=str(BS), cache_dtype="float32",
                 enable_prefix_caching="True", num_gpu_blocks="64") == 1
    # what the heartbeat carries survives the codec, and reads back at vLLM's bounds
    status = decode(encode(InstanceStatus(instance="tiny", name="tiny", version=0, state="ready",
                                          engine=e.metrics.engine_stats())), InstanceStatus)
    stats = status.engine
    assert stats.block_size == BS and stats.num_gpu_blocks == 64 and stats.enable_prefix_caching
    assert stats.prefix_cache_queries == 10 and stats.preemptions == 0
    by_name = {h.name: h for h in stats.histograms}
    assert set(by_name) == set(RELAYED_HISTOGRAMS)
    steps = by_name["vllm:iteration_tokens_total"].counts_at(ITERATION_TOKENS_BUCKETS)
    assert steps[:2] == [3, 3] and steps[-1] == 4  # le=1: three decode steps; le=8 too; +Inf: all four
    inference = by_name["vllm:request_inference_time_seconds"].counts_at(REQUEST_LATENCY_BUCKETS)
    assert len(inference) == len(REQUEST_LATENCY_BUCKETS) + 1 and inference[-1] == 1


class FakeNvml:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return SimpleNamespace(gpu=85, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=3 << 30, total=141 << 30, free=138 << 30)


def test_steps_that_mix_prefill_and_decode_are_counted_as_mixed():
    e = Engine("unified")
    e.scheduler.add_request(req("a", "t", max_tokens=5))
    e.step()  # a's prompt
    e.scheduler.add_request(req("b", "t", max_tokens=2))
    e.step()  # a decodes while b's prompt goes in: mixed
    snap = samples(e.metrics.registry)
    assert value(snap, "kvrelay_engine_steps_total", model_name="tiny", kind="prefill") == 1
    assert value(snap, "kvrelay_engine_steps_total", model_name="tiny", kind="mixed") == 1


@pytest.mark.parametrize("fail", [False, True])
def test_gpu_series_from_nvml(fail):
    collected = {f.name: f for f in HostCollector(FakeNvml(fail), [("GPU-1234", object())]).collect()}
    assert {"kvrelay_node_load1", "kvrelay_node_load5", "kvrelay_node_load15"} <= collected.keys()
    util = collected["kvrelay_gpu_utilization_ratio"].samples
    if fail:  # a failed query drops the series from this scrape instead of failing it
        assert util == []
        return
    assert [(s.labels, s.value) for s in util] == [({"gpu": "GPU-1234"}, 0.85)]
    assert collected["kvrelay_gpu_memory_used_bytes"].samples[0].value == 3 << 30
    assert collected["kvrelay_gpu_memory_total_bytes"].samples[0].value == 141 << 30


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        WorkerMetrics(SimpleNamespace(), "m", "router", "w")


def test_merged_metrics_serve_every_hosted_model_in_one_exposition():
    merged = MergedMetrics()
    engines = {}
    for name in ("a@1", "b@2"):
        e = Engine("unified")
        metrics = WorkerMetrics(e, name, "unified", "w1", process_collectors=not merged.registries)
        merged.registries[name] = metrics.registry
        engines[name] = (e, metrics)
    engines["a@1"][1].request_done("stop", time.time() - 1)
    text = generate_latest(merged.registry).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name, as the text format requires
    snap = samples(merged.registry)
    assert value(snap, "vllm:request_success_total", model_name="a@1", finished_reason="stop") == 1
    assert value(snap, "vllm:request_success_total", model_name="b@2", finished_reason="stop") == 0
    assert ("vllm:num_requests_running", (("model_name", "b@2"),)) in snap
    assert sum(1 for key in snap if key[0] == "process_resident_memory_bytes") == 1
    del merged.registries["b@2"]  # unloaded: gone from the next scrape
    assert ("vllm:num_requests_running", (("model_name", "b@2"),)) not in samples(merged.registry)


@pytest.mark.parametrize("names", [False, True])
def test_tenants_are_hashed_in_a_real_scrape_unless_names_are_asked_for(names):
    """What ``--metrics-tenant-labels`` chooses in the worker runtime: the tenant's name, or its hash."""
    import requests

    from kvrelay.shared.wire.tenant_label import tenant_hash, tenant_labeler

    salt = "deployment-salt"
    e = Engine("unified")
    e.metrics.tenant_label = tenant_labeler(None if names else salt)
    e.scheduler.add_request(req("r0", "acme-corp"))
    while e.scheduler.has_unfinished():
        e.step()
    served = MergedMetrics()  # what the worker serves on --monitoring-port
    served.registries["tiny"] = e.metrics.registry
    port = served.serve("127.0.0.1", 0)
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        served.close()
    tokens = {s.labels["tenant"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "kvrelay_worker_tenant_tokens_total"}
    label = "acme-corp" if names else tenant_hash(salt, "acme-corp")
    assert tokens == {label: 10 + 2}  # the prompt, then two decode steps
    assert ("acme-corp" in text) == names
    assert len(tenant_hash(salt, "acme-corp")) == 12 and tenant_hash(salt, "acme-corp") != tenant_hash("x", "acme-corp")


def test_the_scrape_server_cuts_a_client_that_stops_mid_headers(monkeypatch):
    import socket

    import requests

    from kvrelay.shared.worker import metrics_server

    monkeypatch.setattr(metrics_server._ScrapeHandler, "timeout", 1.0)
    served = MergedMetrics()
    served.registries["tiny"] = Engine("unified").metrics.registry
    port = served.serve("127.0.0.1", 0)
    try:
        slow = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(20)]
        for sock in slow:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: w\r\nX-Slow: ")
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
        for sock in slow:  # the bound proves "not held forever" (it would block until the 15 s socket timeout)
            try:
                assert sock.recv(1024) == b""
            except ConnectionResetError:
                pass
            sock.close()
    finally:
        served.close()
