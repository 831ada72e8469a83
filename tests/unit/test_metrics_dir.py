"""kvrelay/metrics_dir.py: the folder gateways sharing a port keep their Prometheus values in. A real gateway-like
process writes into it and is killed with -9 holding a request in flight: its counters stay in the sums, its gauges
leave them once serve says it is gone, and the folder goes with serve."""

import os
import signal
import subprocess
import sys

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from kvrelay.metrics_dir import MetricsDir

WRITER = """
import sys, time
from prometheus_client import CollectorRegistry, Counter, Gauge
registry = CollectorRegistry()
Counter("served", "requests", registry=registry).inc(3)
Gauge("in_flight", "requests", multiprocess_mode="livesum", registry=registry).inc()
print("written", flush=True)
time.sleep(60)
"""


def sums(path: str) -> dict[str, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return {s.name: s.value for family in registry.collect() for s in family.samples}


def test_a_killed_gateways_counters_stay_and_its_gauges_go():
    folder, procs = MetricsDir({"gateway", "gateway-1"}), []
    try:
        procs += [subprocess.Popen([sys.executable, "-c", WRITER], env=os.environ | folder.env, stdout=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        for proc in procs:
            assert proc.stdout.readline().strip() == "written"
        assert sums(folder.path) == {"served_total": 6.0, "in_flight": 2.0}
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        folder.gone(procs[0].pid)
        assert sums(folder.path) == {"served_total": 6.0, "in_flight": 1.0}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        folder.remove()
    assert not os.path.exists(folder.path)
