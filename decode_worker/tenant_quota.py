"""--tenant-kv-quota on a decode worker: a handed-off request joins the running batch without passing the engine's
admission, so its grant is where the quota holds. The rule is admission's (shared/engine/admission.py: the same
setting, a share of this model's KV blocks here; a tenant holding none may always start one request), counted
over what the tenant holds on this worker: its running requests' blocks and those granted to it or holding its
arriving KV.

An ask that would take its tenant past the quota is refused as ``OverQuota``, a ``Busy`` refusal: the prefill
worker keeps the KV and asks again, as it does for a seat, until its job's deadline, and then fails the request
with the refusal's reason, as a seat wait does. That loop is reused rather than a grant queue built beside it,
because it already carries everything a waiting handoff needs: the asker's liveness (a dead asker stops asking;
a held ask would have to be swept), the job's deadline and abort (the asker drops the transfer), the seat-wait
metrics, and a choice of decode worker on every round, where another one may still have room for that tenant.
A grant queue would pin the request to this worker and add a state to both sides. The answer says which wait
it is (HandoffGrant.over_quota) so logs and metrics tell a quota wait from a full batch.

Re-asks come back in any order, so the order is kept here: each (model, tenant) has a line of the asks refused
for its quota, oldest first, and while it is not empty only its head may be granted; when the tenant's blocks
free, its oldest waiting ask is granted first. Other tenants' asks never look at that line. An ask that stops
coming back (granted on another worker, aborted, failed) leaves the line once it has not been seen for
``QUOTA_LINE_GRACE_S`` plus the hold its asker asked for (HandoffRequest.hold_s: how long it may take between
two reads of our answers), so a gone head holds its tenant up by that much at most. An early ask (made before
the prompt is prefilled, HandoffRequest.early) is refused without joining the line: its asker parks it until
the prompt is computed, and a parked head would only hold its tenant up. An ask naming no tenant (an older
prefill worker) is not counted against any quota.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.shared.handoff.grants import OverQuota
from kvrelay.shared.wire.handoff import HandoffRequest

QUOTA_LINE_GRACE_S = 1.0  # a re-ask comes every 0.2 s, or once per step of its asker (hold_s covers those)


@dataclass
class _Waiter:
    seen: float  # monotonic time of its latest ask
    grace_s: float  # unseen for this long, it has left the line


class TenantQuota:
    def __init__(self) -> None:
        # (model, tenant) -> request id -> its wait, oldest first (dicts keep insertion order)
        self._lines: dict[tuple[str, str], dict[str, _Waiter]] = {}
        self.on_wait: Callable[[str, str], None] = lambda model, tenant: None  # a request starts waiting
        self.on_grant: Callable[[str, str, int], None] = lambda model, tenant, blocks: None  # blocks held with it
        self._engine_held: dict[str, dict[str, int]] = {}  # model -> tenant -> blocks its engine holds, this round

    def new_round(self) -> None:
        """The engine may have stepped since the last round of asks: count what its tenants hold again, once a
        round (O(blocks in use) per count, where a round may answer a step's worth of asks)."""
        self._engine_held.clear()

    def _held(self, core, model: str, tenant: str, pending: Callable[[str, str], int]) -> int:
        if model not in self._engine_held:
            self._engine_held[model] = core.tenant_kv_blocks()
        return self._engine_held[model].get(tenant, 0) + pending(model, tenant)

    def check(self, core, req: HandoffRequest, pending: Callable[[str, str], int]) -> OverQuota | None:
        """None if ``req`` may be granted under its tenant's quota on ``core`` (or none applies), else the refusal;
        then it is in its tenant's line. ``pending(model, tenant)``: blocks granted here to the tenant's requests
        or holding their arriving KV."""
        quota = core.tenant_kv_quota
        if quota is None or not req.tenant:
            return None
        now = time.monotonic()
        self._prune(now)
        key = (req.model, req.tenant)
        line = self._lines.get(key, {})
        ahead = next((i for i, rid in enumerate(line) if rid == req.request_id), len(line))
        held = self._held(core, req.model, req.tenant, pending)
        if ahead == 0 and not core.over_tenant_kv_quota(held, req.num_tokens):
            return None
        if req.early:  # parked until its prompt is prefilled: it joins the line when it asks again then
            self.leave(req)
        else:
            if req.request_id not in line:
                self.on_wait(*key)
            line = self._lines.setdefault(key, line)
            line[req.request_id] = _Waiter(now, QUOTA_LINE_GRACE_S + req.hold_s)
        need = math.ceil(req.num_tokens / core.block_size)
        return OverQuota(f"tenant {req.tenant!r} holds {held} KV blocks here and this request needs {need} more, past "
                         f"its --tenant-kv-quota {quota} of {core.num_total_blocks} blocks; {ahead} of its requests "
                         "wait ahead of it")

    def granted(self, core, req: HandoffRequest, blocks: list[int], pending: Callable[[str, str], int]) -> None:
        """``blocks`` were reserved for ``req``: it waits no more, and what its tenant holds here with them is
        told ``on_grant`` (counted again, not taken from ``check``: the metric checks the check)."""
        self.leave(req)
        if core.tenant_kv_quota is not None and req.tenant:
            held = self._held(core, req.model, req.tenant, pending) + len(blocks)
            self.on_grant(req.model, req.tenant, held)

    def leave(self, req: HandoffRequest) -> None:
        """``req`` waits no more here (granted, or refused for good)."""
        line = self._lines.get((req.model, req.tenant))
        if line is not None and line.pop(req.request_id, None) is not None and not line:
            del self._lines[(req.model, req.tenant)]

    def waiting(self, model: str) -> int:
        """Asks of ``model`` waiting now for their tenant's quota (read by the metrics thread)."""
        now = time.monotonic()
        return sum(1 for (m, _), line in list(self._lines.items()) if m == model
                   for w in list(line.values()) if now - w.seen <= w.grace_s)

    def _prune(self, now: float) -> None:
        for key, line in list(self._lines.items()):
            for rid in [rid for rid, w in line.items() if now - w.seen > w.grace_s]:
                del line[rid]
            if not line:
                del self._lines[key]
