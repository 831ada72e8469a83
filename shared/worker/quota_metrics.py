"""A decode worker's series for --tenant-kv-quota on handed-off requests (decode_worker/tenant_quota.py): how many
waited for their tenant's quota, and the most KV blocks each tenant held here at a grant, which the quota bounds
(the blocks its running requests grow into by decoding come on top, as on admission). How many wait now is
WorkerMetrics' kvrelay_handoff_waiting_for_quota, which prefill workers show too."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, tenant_label: Callable[[str], str]):
        self.model, self.tenant_label = model_name, tenant_label
        labels = ["model_name", "tenant"]
        self._waits = Counter("kvrelay_handoff_quota_waits", "Handed-off requests that waited for a grant here "
                              "because their tenant held its --tenant-kv-quota of this worker's KV (counted as "
                              "each enters the tenant's line)", labels, registry=registry)
        self._peak = Gauge("kvrelay_handoff_tenant_kv_blocks_peak", "Most KV blocks a tenant held on this decode "
                           "worker as one of its handoffs was granted (its running, granted and arriving requests', "
                           "that grant's included; counted only under --tenant-kv-quota)", labels, registry=registry)
        self._peaks: dict[str, int] = {}

    def waited(self, tenant: str) -> None:
        self._waits.labels(self.model, self.tenant_label(tenant)).inc()

    def granted(self, tenant: str, blocks_held: int) -> None:
        if blocks_held > self._peaks.get(tenant, 0):
            self._peaks[tenant] = blocks_held
            self._peak.labels(self.model, self.tenant_label(tenant)).set(blocks_held)
