"""The gateway's Prometheus metrics, in a registry of its own per app (two apps in one process, as the
tests run them, never share counters), served at ``GET /metrics``.

The ``kvrelay_*`` ones only the front door sees: HTTP traffic, time to first token as the client
experiences it (queueing included), rate-limit rejections, tokens per tenant, response-cache hits,
requests in flight, and the queues (``queue_stats.py``). Beside them, vLLM's request-level series
(``VllmRequestMetrics``), so a dashboard built for vLLM's API server works pointed at the gateway.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kvrelay.gateway.choice import ChoiceDelta, ChoiceState
from kvrelay.gateway.queue_stats import QueueStats
from kvrelay.gateway.sse import STREAM_COMPLETE

if TYPE_CHECKING:  # generation.py reaches the metrics through state.py, which imports this module
    from kvrelay.gateway.generation import Generation

# vLLM's TTFT buckets, so dashboards can put the gateway's view next to the engine's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM V1's (vllm/v1/metrics/loggers.py), so quantiles and SLO thresholds read as on vLLM
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 series up to max_model_len; one gateway serves models of every length, so up to a million
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)
COMPLETED = ("stop", "length")  # finish reasons whose latency and size describe the service
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
UNMATCHED_ROUTE = "unmatched"  # 404s keep their own label: raw paths would make label values unbounded


class GatewayMetrics:
    def __init__(self, queue_cache_s: float = 1.0):
        self.registry = registry = CollectorRegistry()
        # how a tenant label shows a tenant: redis_ctx sets a hash unless --metrics-tenant-labels
        self.tenant: Callable[[str], str] = str
        self.http_requests = Counter("kvrelay_http_requests", "HTTP requests by route template and status",
                                     ["route", "status"], registry=registry)
        self.http_latency = Histogram("kvrelay_http_request_duration_seconds", "Time from request to the last "
                                      "byte of the response (whole stream for SSE)", ["route"],
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("kvrelay_ttft_seconds", "Time from a request's arrival at the gateway to its "
                              "first generated token", ["model"], buckets=TTFT_BUCKETS, registry=registry)
        self.rate_limited = Counter("kvrelay_rate_limited", "Requests refused with 429 by a tenant limit",
                                    ["tenant", "reason"], registry=registry)
        self.tenant_tokens = Counter("kvrelay_tenant_tokens", "Tokens served per tenant and model, by kind "
                                     "(prompt or completion)", ["tenant", "model", "kind"], registry=registry)
        self.cache_hits = Counter("kvrelay_response_cache_hits", "Requests answered from the response cache",
                                  ["tenant"], registry=registry)
        self.cache_misses = Counter("kvrelay_response_cache_misses", "Cacheable requests the response cache "
                                    "could not answer", ["tenant"], registry=registry)
        self.connections_closed = Counter("kvrelay_connections_closed", "Connections the gateway closed: "
                                          "header_timeout (headers not complete within --timeout-header-read), "
                                          "idle_limit (past --limit-idle-connections)", ["reason"], registry=registry)
        self.in_flight = Gauge("kvrelay_requests_in_flight", "Generation requests admitted and not finished",
                               ["model"], registry=registry)
        self.queues = QueueStats(queue_cache_s)
        registry.register(self.queues)
        self.vllm = VllmRequestMetrics(registry)
        ProcessCollector(registry=registry)  # process_* (CPU, RSS, open fds), as the default registry has

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Outermost, so it sees the status the client got, error responses included."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else UNMATCHED_ROUTE
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:  # what the error middleware lets through (redirects)
            status = exc.status
            raise
        except asyncio.CancelledError:
            # the client went away (nginx's code), unless it had its whole stream already (sse.py)
            status = request.get(STREAM_COMPLETE, 499)
            raise
        finally:
            self.http_requests.labels(route, str(status)).inc()
            self.http_latency.labels(route).observe(time.perf_counter() - start)


@dataclass
class _Clock:
    first: float | None = None  # unix time of the choice's first token here
    last: float | None = None


@dataclass
class _Live:
    generation: "Generation"
    clocks: dict[str, _Clock] = field(default_factory=dict)  # by job id


class VllmRequestMetrics:
    """vLLM's request-level series with vLLM's names, types, buckets and ``model_name`` label (the name the
    client asked for), counted as the gateway sees each request: one choice of ``n`` is one request, as
    vLLM V1 counts it; times run from the request's arrival here to its tokens' arrival here, so they
    include the Redis queue, the handoff and the way back. Workers serve the same names for their own
    part (``shared/worker/metrics.py``): a query summing both counts every request twice (README).

    Running and waiting are this gateway's own requests, so they add up across gateways: waiting until
    the first token (in the Redis stream, or being prefilled), running from then until they end."""

    def __init__(self, registry: CollectorRegistry):
        m = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "From the request's arrival at the gateway to "
                              "its first token there", m, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between consecutive token batches of a request "
                             "reaching the gateway", m, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "From the request's arrival at the gateway to its "
                             "last token there (completed requests)", m, buckets=E2E_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that got a first token",
                                     m, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated, as they reach the gateway",
                                         m, registry=registry)
        self.success = Counter("vllm:request_success", "Requests ended, by finish reason (abort: the client left "
                               "or the gateway gave up)", m + ["finished_reason"], registry=registry)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per completed request",
                                               m, buckets=TOKEN_BUCKETS, registry=registry)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per "
                                                   "completed request", m, buckets=TOKEN_BUCKETS, registry=registry)
        self._live: dict[str, _Live] = {}  # by request id: requests queued and not yet ended
        self._models: set[str] = set()  # every model served so far: its gauges read 0 when idle, as vLLM's
        registry.register(_RequestStates(self))

    def start(self, gen: "Generation") -> None:
        """The request's jobs are queued."""
        self._models.add(gen.prepared.model_name)
        self._live[gen.request_id] = _Live(gen, {c.job_id: _Clock() for c in gen.choices})

    def delta(self, gen: "Generation", choice: ChoiceState, delta: ChoiceDelta) -> None:
        now = time.time()
        model = gen.prepared.model_name
        clock = self._live[gen.request_id].clocks[choice.job_id]
        if delta.token_ids:
            self.generation_tokens.labels(model).inc(len(delta.token_ids))
            if clock.first is None:
                clock.first = now
                self.ttft.labels(model).observe(max(0.0, now - gen.arrival))
                self.prompt_tokens.labels(model).inc(len(choice.prompt_token_ids))
            else:
                self.itl.labels(model).observe(max(0.0, now - clock.last))
            clock.last = now
        if choice.finished:
            self.success.labels(model, choice.finish_reason).inc()
            if choice.finish_reason in COMPLETED:
                self.e2e.labels(model).observe(max(0.0, now - gen.arrival))
                self.request_prompt_tokens.labels(model).observe(len(choice.prompt_token_ids))
                self.request_generation_tokens.labels(model).observe(len(choice.token_ids))

    def finish(self, gen: "Generation") -> None:
        """The request left the gateway; choices that had not ended were aborted."""
        self._live.pop(gen.request_id, None)
        for choice in gen.choices:
            if not choice.finished:
                self.success.labels(gen.prepared.model_name, "abort").inc()

    def states(self) -> dict[str, tuple[int, int]]:
        """(running, waiting) per model."""
        counts = {model: [0, 0] for model in self._models}
        for live in self._live.values():
            gen = live.generation
            for choice in gen.choices:
                if not choice.finished:
                    counts[gen.prepared.model_name][live.clocks[choice.job_id].first is None] += 1
        return {model: (running, waiting) for model, (running, waiting) in counts.items()}


class _RequestStates:
    """``vllm:num_requests_running`` and ``_waiting``, counted from the live requests when scraped."""

    def __init__(self, metrics: VllmRequestMetrics):
        self._metrics = metrics

    def collect(self):
        running = GaugeMetricFamily("vllm:num_requests_running", "This gateway's requests with a first token and "
                                    "not yet ended", labels=["model_name"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "This gateway's requests waiting for their first "
                                    "token (in the Redis stream or being prefilled)", labels=["model_name"])
        for model, (run, wait) in sorted(self._metrics.states().items()):
            running.add_metric([model], run)
            waiting.add_metric([model], wait)
        yield from (running, waiting)
