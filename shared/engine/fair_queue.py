"""The scheduler's waiting queue: one queue per tenant and a virtual token counter per tenant (VTC,
Sheng et al., "Fairness in Serving Large Language Models", OSDI '24).

Why: with one FIFO, a tenant that submits 200 requests at once makes every other tenant wait behind all
of them. Here each tenant's counter grows by the tokens the scheduler grants that tenant (prefill chunks
and decode tokens alike), and admission takes the head of the tenant with the smallest counter, so
capacity is shared by tokens of service, not by arrival order.

* Within a tenant the order is what it always was: FCFS (a preempted request back at the front), or
  (priority, arrival) under the priority policy.
* Under the priority policy priority still comes first: the best head priority across tenants wins,
  and counters only decide between tenants whose heads tie on it.
* A tenant that becomes active (its first request enters the scheduler) is lifted to the smallest
  counter among active tenants, so idling does not bank credit that would let it starve the others
  later. A counter above that minimum (debt) is kept while the tenant is away, and dropped once the
  others catch up or everyone is idle, so counters of departed tenants do not pile up.
* Ties go to the earlier-queued request, so one tenant alone, or fairness off, reproduces the old
  single queue exactly.
"""

import bisect
import itertools

from kvrelay.shared.engine.request import Request


class FairWaitingQueue:
    def __init__(self, policy: str, fair: bool):
        self.priority = policy == "priority"
        self.fair = fair
        self._queues: dict[str, list[Request]] = {}  # non-empty per-tenant queues only
        self._seq: dict[str, int] = {}  # request id -> queue position key; front inserts go negative
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)
        self.counters: dict[str, int] = {}  # virtual tokens served, per tenant
        self._active: dict[str, int] = {}  # tenant -> requests it has in the scheduler (waiting or running)

    # ---- membership ----

    def __len__(self) -> int:
        return len(self._seq)

    def __bool__(self) -> bool:
        return bool(self._seq)

    def requests(self) -> list[Request]:
        """Every waiting request, in the order a single shared queue would hold them."""
        return sorted((r for q in self._queues.values() for r in q), key=self._global_key)

    def add(self, req: Request, front: bool = False) -> None:
        self._seq[req.request_id] = next(self._front) if front and not self.priority else next(self._back)
        q = self._queues.setdefault(req.tenant, [])
        if self.priority:
            bisect.insort(q, req, key=_order)
        elif front:
            q.insert(0, req)
        else:
            q.append(req)

    def remove(self, req: Request) -> None:
        q = self._queues[req.tenant]
        q.remove(req)
        if not q:
            del self._queues[req.tenant]
        del self._seq[req.request_id]

    def pick(self, skip: set[str] | frozenset[str] = frozenset(), passed: dict[str, int] | None = None
             ) -> Request | None:
        """The request admission should try next, ignoring tenants in ``skip`` (over their KV quota) and, per
        tenant, the ``passed[tenant]`` requests at the head of its queue (held back this step: the next stands
        in). Those are always a prefix of the queue, since admission holds back only what pick gave it."""
        best, best_key = None, None
        for tenant, q in self._queues.items():
            if tenant in skip:
                continue
            held = passed.get(tenant, 0) if passed else 0
            if held >= len(q):
                continue
            head = q[held]
            key = self._pick_key(tenant, head)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def _pick_key(self, tenant: str, head: Request) -> tuple:
        if not self.fair:
            return self._global_key(head)
        return (head.priority if self.priority else 0, self.counters.get(tenant, 0), self._seq[head.request_id])

    def _global_key(self, req: Request) -> tuple:
        seq = self._seq[req.request_id]
        return (req.priority, req.arrival_time, seq) if self.priority else (seq,)

    # ---- virtual token counters ----

    def charge(self, tenant: str, num_tokens: int) -> None:
        if self.fair:
            self.counters[tenant] = self.counters.get(tenant, 0) + num_tokens

    def enter(self, tenant: str) -> None:
        """A request of ``tenant`` entered the scheduler (waiting or, prefilled elsewhere, running)."""
        n = self._active.get(tenant, 0)
        if n == 0 and self.fair and self._active:
            floor = min(self.counters.get(t, 0) for t in self._active)
            self.counters[tenant] = max(self.counters.get(tenant, 0), floor)
        self._active[tenant] = n + 1

    def leave(self, tenant: str) -> None:
        """A request of ``tenant`` left the scheduler (finished, aborted)."""
        n = self._active[tenant] - 1
        if n:
            self._active[tenant] = n
            return
        del self._active[tenant]
        if not self._active:
            self.counters.clear()  # nobody to be fair to: nothing owed either way
            return
        floor = min(self.counters.get(t, 0) for t in self._active)
        for t in [t for t, c in self.counters.items() if t not in self._active and c <= floor]:
            del self.counters[t]  # would be lifted to at least the floor on return anyway


def _order(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)
