"""A decode worker's series for asks held for a sibling's KV in flight there (shared/handoff/held_asks.py): how each
held ask ended, and how long it was held. An ask ends ``ready`` (the KV it waited for landed: granted reusing it),
``unblocked`` (that transfer failed, or the wait bound passed: granted on what is cached) or ``dropped`` (its asker
cancelled it or asked again). Counted as each ends, so the three sum to the asks held and answered or given up."""

from prometheus_client import CollectorRegistry, Counter, Histogram

OUTCOMES = ("ready", "unblocked", "dropped")  # held_asks.HoldState's end states (worker may not import handoff)
# from a sibling's KV landing within a step to the wait bound, a quarter of --handoff-timeout-s (10 s by default)
HELD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class HeldAskMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        asks = Counter("kvrelay_handoff_held_asks", "Handoff asks held here until a sibling's KV in flight here "
                       "landed, by how they ended: ready (granted reusing that KV), unblocked (that transfer failed "
                       "or the wait bound passed: granted on what is cached), dropped (the asker cancelled or asked "
                       "again)", ["model_name", "outcome"], registry=registry)
        # every outcome from the start, at zero: a rate over a series that appears late misses its first count
        self._ended = {outcome: asks.labels(model_name, outcome) for outcome in OUTCOMES}
        self._held_s = Histogram("kvrelay_handoff_held_ask_seconds", "How long a handoff ask was held here for a "
                                 "sibling's KV in flight, whatever its outcome", ["model_name"], buckets=HELD_BUCKETS,
                                 registry=registry).labels(model_name)

    def ended(self, outcome: str, held_s: float) -> None:
        """A held ask ended ``outcome`` (one of OUTCOMES) after ``held_s`` seconds held."""
        self._ended[outcome].inc()
        self._held_s.observe(held_s)
