"""Each live worker's engine loop as the gateway judges it, on ``/metrics``: how long it has been in one step
(``kvrelay_worker_step_age_seconds``, from its heartbeat: 0 while it steps) and whether that is past
``--stalled-step-timeout-s``, so no new job goes to it (``kvrelay_worker_stalled``,
gateway/control/stalled_workers.py). Renewed at each scrape (probes.py); labelled as the workers' own series
are (``role``, ``worker_id``). Every gateway reads the same heartbeats: across gateways take one's, or max."""

from prometheus_client.core import GaugeMetricFamily

from kvrelay.shared.wire.protocol import WorkerInfo

_LABELS = ["role", "worker_id"]


class WorkerSteps:
    """A prometheus collector over the last read of the live workers and which of them are stalled."""

    def __init__(self) -> None:
        self.workers: list[WorkerInfo] = []
        self.stalled: set[str] = set()

    def collect(self):
        age = GaugeMetricFamily("kvrelay_worker_step_age_seconds", "How long each worker's engine loop has been "
                                "in one step, as of its last heartbeat (0: stepping, or idle)", labels=_LABELS)
        stalled = GaugeMetricFamily("kvrelay_worker_stalled", "1 for a worker in one step past "
                                    "--stalled-step-timeout-s: no new job is routed to it", labels=_LABELS)
        for w in sorted(self.workers, key=lambda w: w.worker_id):
            age.add_metric([w.role, w.worker_id], w.step_age_s)
            stalled.add_metric([w.role, w.worker_id], float(w.worker_id in self.stalled))
        yield from (age, stalled)
