"""The folder where gateways sharing one port (``--api-server-count`` > 1) keep their Prometheus values, so a
scrape of any of them sums them all (gateway/metrics.py). A fresh folder per serve: files left by an earlier
run would add its counts to this one's."""

import shutil
import tempfile

from prometheus_client import multiprocess

from kvrelay.shared.config.gateway import METRICS_DIR_ENV


class MetricsDir:
    def __init__(self, names: set[str]):
        self.names = names  # the gateways' children, as the supervisor names them
        self.path = tempfile.mkdtemp(prefix="kvrelay-gateway-metrics-")

    @property
    def env(self) -> dict[str, str]:
        """What a gateway's environment needs to write its values here."""
        return {METRICS_DIR_ENV: self.path}

    def gone(self, pid: int) -> None:
        """A gateway exited: its gauges (requests in flight, running, waiting) leave the sums; its counters stay,
        as what it served was served."""
        multiprocess.mark_process_dead(pid, self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
