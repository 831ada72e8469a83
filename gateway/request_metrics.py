"""vLLM's request-level series, with vLLM's names, types, buckets and ``model_name`` label, counted as the
gateway sees each request (``VllmRequestMetrics``), so a dashboard built for vLLM's API server works
pointed at the gateway. They read a request in flight through ``RequestView``, which the API's
``Generation`` satisfies: the metrics know nothing of the API that feeds them.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
# vLLM V1's for the n request parameter
N_BUCKETS = (1, 2, 5, 10, 20)
COMPLETED = ("stop", "length")  # finish reasons whose latency and size describe the service


class ParamsView(Protocol):
    max_tokens: int | None


class ChoiceView(Protocol):
    """One choice (one job) of a request, as the metrics read it."""

    job_id: str
    prompt_index: int  # which of the request's prompts it continues (a completions request may have several)
    params: ParamsView
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None

    @property
    def finished(self) -> bool: ...


class RequestView(Protocol):
    """A request in flight, as the metrics read it."""

    request_id: str
    arrival: float  # unix seconds, at the gateway

    @property
    def model_name(self) -> str: ...

    @property
    def choices(self) -> Sequence[ChoiceView]: ...


@dataclass
class _Clock:
    first: float | None = None  # unix time of the choice's first token here
    last: float | None = None
    ended: bool = False  # out of the running and waiting gauges


@dataclass
class _Live:
    request: RequestView
    clocks: dict[str, _Clock] = field(default_factory=dict)  # by job id


class VllmRequestMetrics:
    """vLLM's request-level series with vLLM's names, types, buckets and ``model_name`` label (the name the
    client asked for), counted as the gateway sees each request: one choice of ``n`` is one request, as
    vLLM V1 counts it; times run from the request's arrival here to its tokens' arrival here, so they
    include the Redis queue, the handoff and the way back. Workers serve the same names for their own
    part (``shared/worker/metrics.py``): a query summing both counts every request twice (README).

    Running and waiting count this gateway's own requests as they move (waiting until the first token, in the
    Redis stream or being prefilled; running from then until they end), as gauges that sum over the live
    gateways sharing the port (gateway/metrics.py's multiprocess mode)."""

    def __init__(self, registry: CollectorRegistry):
        m = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "From the request's arrival at the gateway to "
                              "its first token there", m, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between consecutive token batches of a request "
                             "reaching the gateway", m, buckets=ITL_BUCKETS, registry=registry)
        # vLLM's dashboard plots TPOT; V1 observes it per output token gap, as ITL (vLLM's buckets, the same)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Between consecutive token batches of a "
                              "request reaching the gateway (vLLM's TPOT)", m, buckets=ITL_BUCKETS, registry=registry)
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
        # vLLM observes n once per prompt (each prompt is a request there) and max_tokens once per
        # finished choice
        self.params_n = Histogram("vllm:request_params_n", "The n request parameter, per prompt", m,
                                  buckets=N_BUCKETS, registry=registry)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens request parameter, "
                                           "per finished choice", m, buckets=TOKEN_BUCKETS, registry=registry)
        self.max_generation_tokens = Histogram("vllm:request_max_num_generation_tokens", "The most tokens any "
                                               "choice of a prompt generated, per prompt whose choices all ended",
                                               m, buckets=TOKEN_BUCKETS, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "This gateway's requests with a first token and not yet "
                             "ended", m, multiprocess_mode="livesum", registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "This gateway's requests waiting for their first token (in "
                             "the Redis stream or being prefilled)", m, multiprocess_mode="livesum", registry=registry)
        self._live: dict[str, _Live] = {}  # by request id: requests queued and not yet ended

    def know(self, models: Iterable[str]) -> None:
        """Models a request may name: their gauges show (at 0) before their first request, as vLLM's do from
        start-up, so a dashboard's series exist and an alert on them does not start as "no data"."""
        for model in models:
            self.running.labels(model)
            self.waiting.labels(model)

    def start(self, request: RequestView) -> None:
        """The request's jobs are queued."""
        self.waiting.labels(request.model_name).inc(len(request.choices))
        self.running.labels(request.model_name)
        per_prompt: dict[int, int] = {}
        for choice in request.choices:
            per_prompt[choice.prompt_index] = per_prompt.get(choice.prompt_index, 0) + 1
        for n in per_prompt.values():
            self.params_n.labels(request.model_name).observe(n)
        self._live[request.request_id] = _Live(request, {c.job_id: _Clock() for c in request.choices})

    def delta(self, request: RequestView, choice: ChoiceView, new_tokens: int, now: float) -> None:
        """``choice`` moved on by ``new_tokens`` tokens, or ended, at ``now`` (unix seconds)."""
        model = request.model_name
        clock = self._live[request.request_id].clocks[choice.job_id]
        if new_tokens:
            self.generation_tokens.labels(model).inc(new_tokens)
            if clock.first is None:
                clock.first = now
                if not clock.ended:
                    self.waiting.labels(model).dec()
                    self.running.labels(model).inc()
                self.ttft.labels(model).observe(max(0.0, now - request.arrival))
                self.prompt_tokens.labels(model).inc(len(choice.prompt_token_ids))
            else:
                self.itl.labels(model).observe(max(0.0, now - clock.last))
                self.tpot.labels(model).observe(max(0.0, now - clock.last))
            clock.last = now
        if choice.finished:
            self._end(model, clock)
            self.success.labels(model, choice.finish_reason).inc()
            if choice.params.max_tokens:
                self.params_max_tokens.labels(model).observe(choice.params.max_tokens)
            if choice.finish_reason in COMPLETED:
                self.e2e.labels(model).observe(max(0.0, now - request.arrival))
                self.request_prompt_tokens.labels(model).observe(len(choice.prompt_token_ids))
                self.request_generation_tokens.labels(model).observe(len(choice.token_ids))

    def finish(self, request: RequestView) -> None:
        """The request left the gateway; choices that had not ended were aborted."""
        live = self._live.pop(request.request_id, None)
        for clock in live.clocks.values() if live is not None else ():
            self._end(request.model_name, clock)
        longest: dict[int, int | None] = {}  # per prompt; None once a choice of it was aborted
        for choice in request.choices:
            if not choice.finished:
                self.success.labels(request.model_name, "abort").inc()
            if choice.finished and longest.get(choice.prompt_index, 0) is not None:
                longest[choice.prompt_index] = max(longest.get(choice.prompt_index) or 0, len(choice.token_ids))
            else:
                longest[choice.prompt_index] = None
        for tokens in longest.values():
            if tokens is not None:
                self.max_generation_tokens.labels(request.model_name).observe(tokens)

    def _end(self, model: str, clock: _Clock) -> None:
        """The choice leaves the gauges, once: where it ended, or when its request left unfinished."""
        if not clock.ended:
            clock.ended = True
            (self.waiting if clock.first is None else self.running).labels(model).dec()
