"""A worker's ``/metrics``: the registries of every model it hosts merged into one exposition, served
over HTTP on ``--monitoring-port`` from a daemon thread."""

import logging
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 10.0  # a scraper sends its request at once; a slow one must not hold a thread


class MergedMetrics:
    """Serves the registries of every model a worker hosts as one /metrics: families of the same name
    (one per model, told apart by ``model_name``) are merged, as the exposition format requires.
    Models come and go with loads and unloads; a scrape sees the ones present at that moment."""

    def __init__(self):
        self.registries: dict[str, CollectorRegistry] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server = None

    def describe(self):
        return []  # dynamic: never let registration call collect()

    def collect(self):
        merged: dict[str, Metric] = {}
        for registry in list(self.registries.values()):
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                        family.unit)
                into.samples.extend(family.samples)
        yield from merged.values()

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: ephemeral) from a daemon thread; returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        self._server = make_server(host, port, make_wsgi_app(self.registry), server_class,
                                   handler_class=_ScrapeHandler)
        threading.Thread(target=self._server.serve_forever, name="kvrelay-metrics", daemon=True).start()
        port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, port)
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ScrapeHandler(WSGIRequestHandler):
    """One scrape: a client that sends partial headers and then nothing (prometheus_client's server waits
    forever, a thread per connection) is cut after SCRAPE_TIMEOUT_S; no access log per scrape."""

    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, format: str, *args) -> None:
        pass
