"""Key names from before the hash tags (``redis_keys.py``), and their move to today's, which a gateway
makes once at start (``migrate``) against a single Redis that a durable earlier version left data in.

Moved, with what they hold: the model registry, tenants and API keys (all an operator set up). Where
the new name already holds something (written by a process of this version meanwhile), that wins: a
string is not overwritten, a hash gains only the fields it lacks, a set the members. Dropped: the old
worker and model directories, which the live workers publish again within a heartbeat. Left as they
are: jobs in the old stream names (``README``: stop the gateways and let the workers drain first) and
old dead letters, which an operator may read with XRANGE and delete.

Each batch is one Lua script (atomic; its keys declared): a second gateway starting at the same time
finds the old names gone or moves nothing twice. Never run against a Redis Cluster, which never held
the old names (nor could run the script across slots).
"""

from __future__ import annotations

import redis.asyncio

from kvrelay.shared.wire import redis_keys as keys

OLD_REGISTRY_INDEX = f"{keys.PREFIX}:registry"  # set of names -> {PREFIX}:registry:NAME, strings
OLD_TENANTS_INDEX = f"{keys.PREFIX}:tenants"  # set of names -> {PREFIX}:tenant:NAME, hashes
OLD_API_KEYS_INDEX = f"{keys.PREFIX}:apikeys"  # hash id -> digest; {PREFIX}:apikey:DIGEST, hashes
OLD_WORKERS_INDEX = f"{keys.PREFIX}:workers"  # set of ids -> {PREFIX}:worker:ID
OLD_MODELS_INDEX = f"{keys.PREFIX}:models"  # set of names -> {PREFIX}:model:NAME
BATCH = 200

# KEYS: (old, new) pairs; ARGV[i]: what pair i holds, "string", "hash" or "set"; "drop" deletes the old.
_MOVE = """
local moved = 0
for i = 1, #ARGV do
  local old, new, kind = KEYS[2 * i - 1], KEYS[2 * i], ARGV[i]
  if redis.call('EXISTS', old) == 1 then
    if kind == 'string' then
      if redis.call('EXISTS', new) == 0 then redis.call('SET', new, redis.call('GET', old)) end
    elseif kind == 'hash' then
      local fv = redis.call('HGETALL', old)
      for j = 1, #fv, 2 do redis.call('HSETNX', new, fv[j], fv[j + 1]) end
    elseif kind == 'set' then
      local members = redis.call('SMEMBERS', old)
      for j = 1, #members, 1000 do redis.call('SADD', new, unpack(members, j, math.min(j + 999, #members))) end
    end
    redis.call('DEL', old)
    moved = moved + 1
  end
end
return moved
"""


async def _plan(client: redis.asyncio.Redis) -> list[tuple[str, str, str]]:
    """(old, new, kind) for every old key there is, each index after the records it names."""
    moves: list[tuple[str, str, str]] = []
    for name in await client.smembers(OLD_REGISTRY_INDEX):
        n = name.decode()
        moves.append((f"{keys.PREFIX}:registry:{n}", keys.registry_key(n), "string"))
    moves.append((OLD_REGISTRY_INDEX, keys.REGISTRY_INDEX, "set"))
    for name in await client.smembers(OLD_TENANTS_INDEX):
        n = name.decode()
        moves.append((f"{keys.PREFIX}:tenant:{n}", keys.tenant_key(n), "hash"))
    moves.append((OLD_TENANTS_INDEX, keys.TENANTS_INDEX, "set"))
    for digest in (await client.hgetall(OLD_API_KEYS_INDEX)).values():
        d = digest.decode()
        moves.append((f"{keys.PREFIX}:apikey:{d}", keys.api_key_key(d), "hash"))
    moves.append((OLD_API_KEYS_INDEX, keys.API_KEYS_INDEX, "hash"))
    for index, item in ((OLD_WORKERS_INDEX, "worker"), (OLD_MODELS_INDEX, "model")):
        for name in await client.smembers(index):
            moves.append((f"{keys.PREFIX}:{item}:{name.decode()}", "", "drop"))
        moves.append((index, "", "drop"))
    return moves


async def migrate(client: redis.asyncio.Redis) -> int:
    """Move what the old names hold to the new ones; returns how many old keys there were (0 when done
    before, or for a Redis that never held them)."""
    moves = await _plan(client)
    total = 0
    for i in range(0, len(moves), BATCH):
        batch = moves[i:i + BATCH]
        # a dropped key's "new" name is itself: declared, never written
        names = [k for old, new, _ in batch for k in (old, new or old)]
        total += await client.eval(_MOVE, len(names), *names, *(kind for _, _, kind in batch))
    return total
