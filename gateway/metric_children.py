"""Each labelled series' children looked up once: prometheus_client's ``labels()`` checks and stringifies the
values and takes the metric's lock on every call, a few microseconds each, and a gateway calls it about twenty
times per request and three times per streamed token. The gateway never removes a label set, so a child, once
made, is the metric's for good and can be remembered by its label values."""

import functools

from prometheus_client.metrics import MetricWrapperBase


def remember_children(*holders: object) -> None:
    """Every metric among the attributes of ``holders`` answers ``labels(...)`` from a cache of its children."""
    for holder in holders:
        for metric in vars(holder).values():
            if isinstance(metric, MetricWrapperBase):
                metric.labels = functools.lru_cache(maxsize=None)(metric.labels)
