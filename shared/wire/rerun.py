"""Who re-runs a job whose decode worker died holding it: exactly one of the gateway and the prefill worker.

A decode worker tells the gateway it holds a request (an event naming it) before it acks the KV to the
prefill worker, and the prefill worker names it again on the ack (the decode worker's event may still be
queued behind its connection's handshake, though it opens that connection when it grants), so that the gateway knows whose heartbeat to watch should it die
right after the ack. If
it dies between the two, both sides see it go: the gateway (the holder its events named is gone) queues
the job again from its prompt, and the prefill worker (its transfer never acked: ``target_lost``) hands
its job back to the stream. Each alone is right; together they would run the request twice. Neither can
tell whether the other saw the death: whichever sees it first claims the re-run with one ``SET NX`` on
``rerun_key(job, worker)`` and runs it; the other, finding the claim taken, leaves the job to it (the
gateway forgets the dead holder and waits; the prefill worker acks its entry). Outside that window only
one side ever asks (before the announcement only the prefill worker knows; after the ack only the
gateway), so the claim is always its own.

The key names the decode worker, so a re-run whose new holder dies again is claimed afresh; it lives
until the job's deadline (plus a margin), after which nobody could re-run it anyway. Default worker ids
(host-pid-random) never repeat; a decode worker restarted under the same explicit ``--worker-id`` that dies
again in the same window holding the same job finds the claim taken on both sides, and that request ends
with ``worker_lost`` (or at its deadline) instead of a third run.
"""

import time

import redis
import redis.asyncio

from kvrelay.shared.wire import redis_keys as keys

MARGIN_S = 60


def _ttl(deadline: float) -> int:
    return max(1, int(deadline - time.time()) + MARGIN_S)


def claim(r: redis.Redis, job_id: str, worker_id: str, deadline: float, owner: str) -> bool:
    """True: ``owner`` re-runs the job; False: the other side claimed it first."""
    return bool(r.set(keys.rerun_key(job_id, worker_id), owner, nx=True, ex=_ttl(deadline)))


async def claim_async(r: redis.asyncio.Redis, job_id: str, worker_id: str, deadline: float, owner: str) -> bool:
    return bool(await r.set(keys.rerun_key(job_id, worker_id), owner, nx=True, ex=_ttl(deadline)))
