"""The gateway's Prometheus metrics, in a registry of its own per app (two apps in one process, as the
tests run them, never share counters), served at ``GET /metrics``.

Several gateways on one port (``kvrelay serve --api-server-count N``) answer a scrape each by the kernel's draw,
so serve gives them one folder for prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, as
vLLM's API servers share theirs): whichever gateway is scraped sums every gateway's counters and histograms,
and the live ones' gauges. The collectors that read Redis (queues, the workers' engines and steps) say the same
in every gateway and are read once; the process_* series, one process's each, are left out there.

The ``kvrelay_*`` ones only the front door sees: HTTP traffic, time to first token as the client
experiences it (queueing included), rate-limit rejections, tokens per tenant, response-cache hits,
requests in flight, the queues (``queue_stats.py``) and the workers' engine loops (``worker_steps.py``).
Beside them, vLLM's request-level series (``request_metrics.py``) and the engines' series the workers'
heartbeats carry (``engine_metrics.py``), so a dashboard built for vLLM's API server works pointed at the
gateway.
"""

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from kvrelay.gateway.engine_metrics import EngineMetrics
from kvrelay.gateway.metric_children import remember_children
from kvrelay.gateway.queue_stats import QueueStats
from kvrelay.gateway.request_metrics import TTFT_BUCKETS, VllmRequestMetrics
from kvrelay.gateway.ttft_stages import TtftStages
from kvrelay.gateway.worker_steps import WorkerSteps
from kvrelay.shared.config.gateway import METRICS_DIR_ENV

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
UNMATCHED_ROUTE = "unmatched"  # 404s keep their own label: raw paths would make label values unbounded
# Set once a stream was written in full. A proxy (nginx) closes the moment the last chunk arrives, and
# aiohttp then cancels the handler wherever it still awaits (settling usage, say): the middleware below
# counts such a request by what the client got, not as a disconnect.
STREAM_COMPLETE = web.RequestKey("stream_complete", int)


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
        # Jobs Redis no longer held when their request looked for them (a failover to a replica that had not
        # received them yet, a restart without them: ``gone``) or could not be asked about in time (a
        # too long outage: ``outage``); each request answered 503 queue_lost, counted once per lost job.
        self.queued_jobs_lost = Counter("kvrelay_queued_jobs_lost", "Queued jobs lost by Redis, each request "
                                        "answered 503 queue_lost: gone (after a failover or restart) or outage",
                                        ["cause"], registry=registry)
        self.job_writes_unreplicated = Counter("kvrelay_job_writes_unreplicated", "Jobs fewer replicas than "
                                               "--redis-min-replicas confirmed within --redis-replica-wait-ms",
                                               registry=registry)
        self.in_flight = Gauge("kvrelay_requests_in_flight", "Generation requests admitted and not finished",
                               ["model"], multiprocess_mode="livesum", registry=registry)
        self.queues = QueueStats(queue_cache_s)
        registry.register(self.queues)
        self.vllm = VllmRequestMetrics(registry)
        self.ttft_stages = TtftStages(registry)
        self.engines = EngineMetrics()  # the workers' engine series, renewed from their heartbeats when scraped
        registry.register(self.engines)
        self.worker_steps = WorkerSteps()  # renewed with the engines'
        registry.register(self.worker_steps)
        ProcessCollector(registry=registry)  # process_* (CPU, RSS, open fds), as the default registry has
        remember_children(self, self.vllm, self.ttft_stages)
        self.shared = None  # what a scrape renders where gateways share their metrics: see the docstring
        if folder := os.environ.get(METRICS_DIR_ENV):
            self.shared = CollectorRegistry()
            MultiProcessCollector(self.shared, path=folder)
            for collector in (self.queues, self.engines, self.worker_steps):
                self.shared.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.shared if self.shared is not None else self.registry)

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
            # the client went away (nginx's code), unless it had its whole stream already (api/sse.py)
            status = request.get(STREAM_COMPLETE, 499)
            raise
        finally:
            self.http_requests.labels(route, str(status)).inc()
            self.http_latency.labels(route).observe(time.perf_counter() - start)
