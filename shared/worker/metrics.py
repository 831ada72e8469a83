"""One hosted model's Prometheus metrics, served with the others on ``--monitoring-port``
(metrics_server.py).

Names and the ``model_name`` label are vLLM's, so dashboards built for vLLM work unchanged; kvrelay's
own (handoff, tenants, host) are ``kvrelay_*``. The engine reports through ``EngineObserver`` (one call
per step, on the engine's thread); gauges are read when scraped, so they are never stale and fall back
to zero by themselves when the worker is idle.

Which worker sees what, so that sums across workers count each thing once:
* prefill: queue time, TTFT, prompt tokens, the first generated token, handoffs, and the requests that
  end at their first token (EOS, max_tokens=1);
* decode: every later token, inter-token latency, e2e latency and finish reasons. Its first ITL sample
  is the gap between its first two decode steps: the prefill->decode gap is the handoff, measured
  by the prefill worker as ``kvrelay_handoff_seconds``;
* unified: all of the above.
Per-request phases (vLLM's queue, prefill, decode and inference times; inference = prefill + decode,
from the first scheduling to the last token): a unified worker observes all four for each completed
request; a prefill worker queue and prefill time; a decode worker decode time and, as inference time,
its own span (the request's prefill ran on another engine, which counts it as that engine's prefill
time). A request that ends at its first token on a prefill worker has no decode or inference sample.
``engine_stats`` snapshots the engine-level series for the heartbeat, which carries them to the
gateway's ``/metrics`` (shared/wire/engine_stats.py).
Latencies count from the Job's ``arrival`` (the gateway's clock), so they include the time in the Redis
queue and assume hosts' clocks agree (NTP).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily

from kvrelay.shared.engine import SchedulerOutput
from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.engine_stats import ITERATION_TOKENS_BUCKETS, RELAYED_HISTOGRAMS, EngineStats, HistogramCounts
from kvrelay.shared.worker.held_ask_metrics import HeldAskMetrics
from kvrelay.shared.worker.host_stats import HostCollector, nvml_for
from kvrelay.shared.worker.prompt_budget_metrics import PromptBudgetCollector
from kvrelay.shared.worker.quota_metrics import QuotaMetrics

# vLLM's buckets, with finer steps below 10 ms for GPU decode and around the 500 ms e2e alert threshold.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# engine steps: fine between 2 and 50 ms, where a graph-replayed decode step and an eager one with prompt tokens lie
STEP_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.075,
                0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
PROMPT_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

ROLES = ("prefill", "decode", "unified")


@dataclass
class _Seen:
    scheduled: float  # unix time of this request's first step on this worker
    first_token: float | None = None  # of its first token here
    last_token: float | None = None  # of its latest token here


class WorkerMetrics:
    def __init__(self, core, model_name: str, role: str, worker_id: str, device: str = "cpu",
                 process_collectors: bool = True, tenant_label: Callable[[str], str] = str):
        """One model's metrics. A worker hosting several models makes one per model and serves them all
        through ``MergedMetrics`` (metrics_server.py); only one of them carries the process and host collectors.
        ``tenant_label``: how a tenant is shown (shared/wire/tenant_label.py: a hash unless names are asked for)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.core = core
        self.model = model_name
        self.first_token_here = role in ("prefill", "unified")
        self.later_tokens_here = role in ("decode", "unified")
        self.role = role
        self.tenant_label = tenant_label
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self._seen: dict[str, _Seen] = {}

        Gauge("kvrelay_worker_info", "This worker's role and id (always 1), for joins",
              m + ["role", "worker_id"], registry=r).labels(model_name, role, worker_id).set(1)
        Gauge("vllm:num_requests_running", "Requests in the running batch", m,
              registry=r).labels(model_name).set_function(lambda: core.num_running)
        Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", m,
              registry=r).labels(model_name).set_function(lambda: core.num_waiting)
        Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)", m,
              registry=r).labels(model_name).set_function(lambda: core.kv_usage)
        Gauge("kvrelay_model_overhead_bytes", "Memory this model keeps while loaded besides its weights and KV (CUDA "
              "graphs, buffers), as measured after its load", m,
              registry=r).labels(model_name).set_function(lambda: core.resident_overhead_bytes)
        Gauge("kvrelay_model_step_peak_bytes", "This model's largest step's temporaries above what it keeps, as "
              "warm-up measured them (CUDA; 0 elsewhere)", m,
              registry=r).labels(model_name).set_function(lambda: core.step_peak_bytes)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests prefilled here", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated here", m,
                                         registry=r).labels(model_name)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (swap or recompute)", m,
                                   registry=r).labels(model_name)
        # decode: one new token per sequence (what a CUDA graph replays); a step holding any prefill chunk
        # runs the whole batch eagerly, so a high mixed share explains a slow TPOT
        steps = Counter("kvrelay_engine_steps", "Engine steps by kind: decode (one token per sequence), "
                        "prefill (prompt chunks only) or mixed", m + ["kind"], registry=r)
        self._steps = {kind: steps.labels(model_name, kind) for kind in ("decode", "prefill", "mixed")}
        # what a decoding request waits between two tokens, by whether a step with prompt tokens (eager) ran in
        # the gap: with async scheduling the next step's launch is inside it, so its prompt tokens count too
        step_seconds = Histogram("kvrelay_engine_step_seconds", "Engine step time as its requests waited for its "
                                 "tokens (from the read of the step before, or its launch if later, to its read): "
                                 "decode (no prompt tokens in the gap), mixed (prompt tokens beside decode rows) or "
                                 "prefill (prompt tokens only); with async scheduling the step launched before the "
                                 "read is in the gap", m + ["kind"], buckets=STEP_BUCKETS, registry=r)
        self._step_seconds = {kind: step_seconds.labels(model_name, kind) for kind in ("decode", "prefill", "mixed")}
        self.prompt_beside_decodes = Histogram(
            "kvrelay_engine_step_prompt_tokens", "Prompt tokens of each step that had decode rows (0: decode only): "
            "what --max-prefill-tokens-with-decodes or --target-step-ms let in beside them", m,
            buckets=PROMPT_TOKEN_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests ended here, by finish reason",
                                m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "From the request's arrival to its first token",
                              m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between consecutive output tokens", m,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "From the request's arrival to its last token",
                             m, buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        queue_time = Histogram("vllm:request_queue_time_seconds",
                               "From the request's arrival (Redis queue included) to its first scheduling",
                               m, buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = queue_time.labels(model_name)
        # vLLM's phase histograms: REQUEST_BUCKETS holds every vLLM bound, so the gateway reads vLLM's
        # buckets off them exactly
        self._relayed = {"vllm:request_queue_time_seconds": queue_time}  # what the heartbeat carries
        for phase, doc in (("prefill", "From the request's first scheduling here to its first token"),
                           ("decode", "From its first token (a decode worker: its first step here) to its last token"),
                           ("inference", "From the request's first scheduling here to its last token (prefill + "
                                         "decode on this engine)")):
            name = f"vllm:request_{phase}_time_seconds"
            self._relayed[name] = Histogram(name, doc, m, buckets=REQUEST_BUCKETS, registry=r)
        self.phases = {p: self._relayed[f"vllm:request_{p}_time_seconds"].labels(model_name)
                       for p in ("prefill", "decode", "inference")}
        self._relayed["vllm:iteration_tokens_total"] = Histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step, as vLLM counts them: the prompts of requests "
            "whose first token came in the step, and the tokens generated in it",
            m, buckets=ITERATION_TOKENS_BUCKETS, registry=r)
        self.iteration_tokens = self._relayed["vllm:iteration_tokens_total"].labels(model_name)
        self._preempted = 0  # lifetime, for the heartbeat
        cache = core.config.cache
        self.cache_info = {"block_size": str(core.block_size), "cache_dtype": str(core.kv_dtype).removeprefix("torch."),
                           "enable_prefix_caching": str(cache.enable_prefix_caching),
                           "num_gpu_blocks": str(core.num_total_blocks)}
        Gauge("vllm:cache_config_info", "This engine's KV cache configuration (always 1)",
              m + sorted(self.cache_info), registry=r).labels(model_name, *(
                  self.cache_info[k] for k in sorted(self.cache_info))).set(1)
        self._tenant_tokens = Counter("kvrelay_worker_tenant_tokens", "Tokens computed per tenant (prefill "
                                      "chunks and decode steps; what fair scheduling counts)", m + ["tenant"],
                                      registry=r)
        self.handoff_bytes = Counter("kvrelay_handoff_bytes", "KV bytes handed off to decode workers", m,
                                     registry=r).labels(model_name)
        self.handoff_seconds = Histogram("kvrelay_handoff_seconds", "From the first token to the decode side's ack",
                                         m, buckets=HANDOFF_BUCKETS, registry=r).labels(model_name)
        self.handoff_failures = Counter("kvrelay_handoff_failures", "Handoffs that failed (request ended in error)",
                                        m, registry=r).labels(model_name)
        self.seat_wait = Histogram("kvrelay_handoff_seat_wait_seconds",
                                   "Time prefilled requests waited for a decode seat (refused for a full batch, "
                                   "no free KV blocks, or their tenant's --tenant-kv-quota there) before their KV "
                                   "moved; only those that waited, so _count is how many did", m,
                                   buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        # set by a prefill worker's role (prefill_worker/worker.py): its handoffs know who waits
        self.seat_waiting: Callable[[], int] = lambda: 0
        Gauge("kvrelay_handoff_waiting_for_seat", "Prefilled requests waiting now for a decode seat (a full batch, "
              "no free KV blocks), their KV held here", m, registry=r).labels(model_name).set_function(
                  lambda: self.seat_waiting())
        # set by the role: a prefill worker's transfers, a decode worker's asks in line (decode_worker/tenant_quota.py)
        self.quota_waiting: Callable[[], int] = lambda: 0
        Gauge("kvrelay_handoff_waiting_for_quota", "Handoffs waiting now for a decode worker's grant because their "
              "tenant holds its --tenant-kv-quota there: on a prefill worker those whose KV it holds, on a decode "
              "worker the asks in line there", m, registry=r).labels(model_name).set_function(
                  lambda: self.quota_waiting())
        self.quota = QuotaMetrics(r, model_name, tenant_label) if role == "decode" else None
        self.held_asks = HeldAskMetrics(r, model_name) if role == "decode" else None
        # a decode worker's side of its handoffs: what arrived, and the prompt blocks it held already (not sent)
        self.handoff_received_bytes = Counter("kvrelay_handoff_received_bytes", "KV bytes of handoffs admitted "
                                              "here", m, registry=r).labels(model_name)
        self.handoff_reused_blocks = Counter("kvrelay_handoff_reused_blocks", "Prompt KV blocks of handoffs admitted "
                                             "here that this worker held already (prefix cache), so were not sent",
                                             m, registry=r).labels(model_name)
        self._handoffs = Counter("kvrelay_handoffs", "Handoffs that landed, by transport (ipc, layers, rank_layers: "
                                 "sent by each rank of a sharded worker) and by "
                                 "whether the KV streamed out layer by layer during the prompt's last chunk",
                                 m + ["transport", "streamed"], registry=r)
        world = core.config.tensor_parallel_size * core.config.pipeline_parallel_size
        if world > 1:  # a sharded decode worker's ranks 1..N-1 each take their own share of arriving KV
            rank_bytes = Gauge("kvrelay_handoff_rank_received_bytes", "KV bytes a rank other than 0 took on its "
                               "own socket (its share of handed-off KV; lifetime total)", m + ["rank"], registry=r)
            for rank in range(1, world):
                rank_bytes.labels(model_name, str(rank)).set_function(
                    lambda rank=rank: core.kv.rank_bytes_received.get(rank, 0))
        r.register(_PrefixCacheCollector(core, model_name))
        if self.later_tokens_here:  # a prefill worker's requests never decode: nothing caps its prompts
            r.register(PromptBudgetCollector(core, model_name))
        if process_collectors:
            r.register(HostCollector(*nvml_for(device)))
            ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds

    # -- EngineObserver -------------------------------------------------------------------------
    def on_step(self, started: float, out: SchedulerOutput, finished: list[Request]) -> None:
        now = time.time()
        if out.preempted:
            self.preemptions.inc(len(out.preempted))
            self._preempted += len(out.preempted)
        if out.scheduled:
            single = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
            kind = "decode" if single == len(out.scheduled) else "prefill" if not single else "mixed"
            self._steps[kind].inc()
            # vLLM's count, not the tokens computed: a request whose first token comes in this step adds its
            # whole prompt (prefix-cached or not, however chunked), and every token sampled adds one
            self.iteration_tokens.observe(sum(
                (s.request.num_prompt_tokens if s.request.num_output_tokens == 1 else 0) + 1
                for s in out.scheduled if s.sample))
            self._observe_shape(out)
        per_tenant: dict[str, int] = {}
        for s in out.scheduled:
            req = s.request
            per_tenant[req.tenant] = per_tenant.get(req.tenant, 0) + s.num_new_tokens
            seen = self._seen.get(req.request_id)
            if seen is None:
                seen = self._seen[req.request_id] = _Seen(scheduled=started)
                if self.first_token_here:
                    self.queue_time.observe(max(0.0, started - req.arrival_wall))
            if not s.sample:
                continue
            self.generation_tokens.inc()
            if seen.last_token is None:
                seen.first_token = now
                if self.first_token_here and req.num_output_tokens == 1:
                    self.ttft.observe(max(0.0, now - req.arrival_wall))
                    self.prompt_tokens.inc(req.num_prompt_tokens)
                    self.phases["prefill"].observe(max(0.0, now - seen.scheduled))
            elif self.later_tokens_here:
                self.itl.observe(now - seen.last_token)
            seen.last_token = now
        for tenant, n in per_tenant.items():
            self._tenant_tokens.labels(self.model, self.tenant_label(tenant)).inc(n)
        for req in finished:
            seen = self._seen.pop(req.request_id, None)
            # a prefill worker's engine ends every request at its first token; whether the request
            # really ended there is the worker's call (request_done)
            if self.role != "prefill":
                self.request_done(req.status.value, req.arrival_wall, now)
                self._phases_done(req.status.value, seen)

    def _observe_shape(self, out: SchedulerOutput) -> None:
        if out.shape.decode_rows:
            self.prompt_beside_decodes.observe(out.shape.prompt_tokens)
        if out.seconds is None:
            return
        shapes = [out.shape] if out.beside is None else [out.shape, out.beside]
        if not any(s.prompt_tokens for s in shapes):
            kind = "decode"
        else:
            kind = "mixed" if any(s.decode_rows for s in shapes) else "prefill"
        self._step_seconds[kind].observe(out.seconds)

    def on_removed(self, requests: list[Request]) -> None:
        now = time.time()
        for req in requests:
            seen = self._seen.pop(req.request_id, None)
            self.request_done(req.status.value, req.arrival_wall, now)
            if self.role != "prefill":
                self._phases_done(req.status.value, seen)

    def _phases_done(self, finish_reason: str, seen: _Seen | None) -> None:
        """Decode and inference time of a request that completed here (as e2e: stop or length only)."""
        if seen is None or seen.last_token is None or finish_reason not in ("stop", "length"):
            return
        # a decode worker's first token here is the request's second: its decoding began at its first step
        decode_from = seen.first_token if self.role == "unified" and seen.first_token is not None else seen.scheduled
        self.phases["decode"].observe(max(0.0, seen.last_token - decode_from))
        self.phases["inference"].observe(max(0.0, seen.last_token - seen.scheduled))

    def engine_stats(self) -> EngineStats:
        """The engine-level series as of now, for the heartbeat (shared/wire/engine_stats.py)."""
        queries, hits = self.core.prefix_cache_stats()
        histograms = [_counts(name, self._relayed[name], self.model) for name in RELAYED_HISTOGRAMS]
        return EngineStats(kv_cache_usage=float(self.core.kv_usage), prefix_cache_queries=int(queries),
                           prefix_cache_hits=int(hits), preemptions=self._preempted,
                           block_size=int(self.cache_info["block_size"]),
                           num_gpu_blocks=int(self.cache_info["num_gpu_blocks"]), cache_dtype=self.cache_info["cache_dtype"],
                           enable_prefix_caching=self.cache_info["enable_prefix_caching"] == "True",
                           histograms=histograms)

    # -- called by the worker loops -------------------------------------------------------------
    def request_done(self, finish_reason: str, arrival: float, now: float | None = None) -> None:
        """A request ended on this worker. Only completed ones (stop, length) enter the latency
        histogram: an abort's duration says when the client gave up, not how fast we served."""
        self._success.labels(self.model, finish_reason).inc()
        if finish_reason in ("stop", "length"):
            self.e2e.observe(max(0.0, (now or time.time()) - arrival))

    def handoff_done(self, nbytes: int, seconds: float, ok: bool, transport: str = "layers",
                     streamed: bool = False, seat_wait_s: float = 0.0) -> None:
        if seat_wait_s > 0:  # also when it failed: a wait that ended at the job's deadline was a wait
            self.seat_wait.observe(seat_wait_s)
        if ok:
            self.handoff_bytes.inc(nbytes)
            self.handoff_seconds.observe(seconds)
            self._handoffs.labels(self.model, transport, str(streamed).lower()).inc()
        else:
            self.handoff_failures.inc()

    def handoff_landed(self, nbytes: int, reused_blocks: int) -> None:
        """A decode worker admitted a handoff: ``nbytes`` of KV arrived, ``reused_blocks`` were held here."""
        self.handoff_received_bytes.inc(nbytes)
        self.handoff_reused_blocks.inc(reused_blocks)


def _counts(name: str, parent: Histogram, model: str) -> HistogramCounts:
    """One model's cumulative bucket counts and sum of ``parent``, read through its public samples."""
    bounds, counts, total = [], [], 0.0
    for family in parent.collect():
        for sample in family.samples:
            if sample.labels.get("model_name") != model:
                continue
            if sample.name.endswith("_bucket"):
                bounds.append(float(sample.labels["le"]))
                counts.append(int(sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
    return HistogramCounts(name=name, bounds=bounds, counts=counts, sum=total)


class _PrefixCacheCollector:
    """The engine's lifetime prefix-cache counts (tokens), read at scrape time."""

    def __init__(self, core, model_name: str):
        self.core = core
        self.model = model_name

    def collect(self):
        queries, hits = self.core.prefix_cache_stats()
        for name, value, doc in (("vllm:prefix_cache_queries", queries, "Prompt tokens looked up"),
                                 ("vllm:prefix_cache_hits", hits, "Prompt tokens found cached")):
            family = CounterMetricFamily(name, doc + " in the prefix cache", labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
