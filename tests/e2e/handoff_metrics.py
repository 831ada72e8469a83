"""A worker's handoff counters read from its /metrics (``--monitoring-port``), summed by one label."""

import time
import urllib.request


def by_label(port: int, metric: str, label: str) -> dict[str, float]:
    """The samples of ``metric`` on the worker's /metrics at ``port``, summed by the value of ``label``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{metric}{{"):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def handoffs_by(port: int, label: str) -> dict[str, float]:
    """kvrelay_handoffs_total by ``label`` (``streamed``, ``transport``), from a prefill worker."""
    return by_label(port, "kvrelay_handoffs_total", label)


def rank_received_bytes(port: int) -> dict[str, float]:
    """kvrelay_handoff_rank_received_bytes by ``rank``, from a decode worker."""
    return by_label(port, "kvrelay_handoff_rank_received_bytes", "rank")


def handoffs_settled(port: int, label: str, at_least: float, bound_s: float = 30.0) -> dict[str, float]:
    """``handoffs_by`` once they sum to ``at_least`` (or at ``bound_s``): a prefill worker counts a handoff when
    it reads the decode worker's ack, which may come after the client already has its answer."""
    end = time.monotonic() + bound_s
    while sum((counts := handoffs_by(port, label)).values()) < at_least and time.monotonic() < end:
        time.sleep(0.05)
    return counts
