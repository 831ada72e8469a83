"""Model records that would never expire. Workers publish ``model_key`` records with ``MODEL_TTL_S`` and
renew it every heartbeat, so a record lapses that long after the last worker holding it is gone. A Redis
that outlived an older kvrelay holds records written with no TTL: once no live worker holds such a model,
nothing would ever remove it, and a direct model would answer 503 for good instead of disappearing. The
reconciler gives such a record the TTL its workers would have given it; a record a live worker holds is
left to that worker."""

import redis.asyncio

from kvrelay.gateway.control.placement import instance_state
from kvrelay.gateway.control.worker_registry import WorkerRegistry
from kvrelay.shared.wire import redis_keys as keys

NO_TTL = -1  # what TTL answers for a key that exists and never expires


async def expire_unheld_records(client: redis.asyncio.Redis, registry: WorkerRegistry) -> list[str]:
    """Give ``MODEL_TTL_S`` to every model record no live worker holds (in any state) and that has no TTL;
    the instances it did that to."""
    workers = await registry.workers(fresh=True)
    unheld = [name for name in await registry.models(fresh=True)
              if not any(instance_state(w, name) is not None for w in workers)]
    if not unheld:
        return []
    pipe = client.pipeline(transaction=False)
    for name in unheld:
        pipe.ttl(keys.model_key(name))
    lasting = [name for name, ttl in zip(unheld, await pipe.execute(), strict=True) if ttl == NO_TTL]
    for name in lasting:
        await client.expire(keys.model_key(name), keys.MODEL_TTL_S)
    return lasting
