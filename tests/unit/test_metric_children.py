"""The gateway's labelled series answer ``labels(...)`` from a cache of their children, and what is counted
through a remembered child is what a scrape shows."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvrelay.gateway.metric_children import remember_children
from kvrelay.gateway.metrics import GatewayMetrics


class _Holder:
    def __init__(self, registry):
        self.requests = Counter("requests", "r", ["model", "kind"], registry=registry)
        self.latency = Histogram("latency", "l", ["model"], buckets=(0.1, 1.0), registry=registry)
        self.note = "not a metric"


def test_a_child_is_looked_up_once_and_counts_as_before():
    registry = CollectorRegistry()
    holder = _Holder(registry)
    remember_children(holder)
    for _ in range(3):
        holder.requests.labels("m", "prompt").inc(2)
        holder.latency.labels(model="m").observe(0.5)
    assert holder.requests.labels.cache_info().misses == 1 and holder.requests.labels.cache_info().hits == 2
    text = generate_latest(registry).decode()
    assert 'requests_total{kind="prompt",model="m"} 6.0' in text
    assert 'latency_bucket{le="1.0",model="m"} 3.0' in text and 'latency_bucket{le="0.1",model="m"} 0.0' in text
    assert holder.note == "not a metric"


def test_every_labelled_series_of_the_gateway_remembers_its_children():
    metrics = GatewayMetrics()
    for holder in (metrics, metrics.vllm, metrics.ttft_stages):
        for name, value in vars(holder).items():
            if hasattr(value, "_labelnames") and value._labelnames:
                assert hasattr(value.labels, "cache_info"), name
