"""Redis Cluster: every key family of redis_keys.py is declared either in a slot group (what one MULTI, Lua
script or multi-key command touches together) or as a single-key family; each group's keys map to one
slot, by a non-empty hash tag, whatever the names in them (":" , "@", braces, long ones). A key family
added to redis_keys.py without a decision, or to a group without the group's tag, fails here.

Slots are redis-py's (``key_slot``: CRC16 of the hash tag, mod 16384), the function its cluster client
routes by."""

import inspect

import pytest
from redis.crc import key_slot

from kvrelay.shared.wire import redis_keys as keys

NOT_KEYS = {"PREFIX", "PREFILL_GROUP", "JOB_FIELD", "ABORT_CHANNEL"}  # a prefix, a group, a field, a channel
# names a model instance, tenant, worker or digest may have; the odd ones exercise the tag's edge cases
NAMES = ["tiny", "tiny@3", "org/model:v2", "a:b@12", "x" * 200, "we{ird}", "}x", "{}", "{", "-"]


def _families() -> dict[str, object]:
    out = {}
    for name, value in vars(keys).items():
        if name.startswith("_") or name in NOT_KEYS:
            continue
        if (isinstance(value, str) and value.startswith(keys.PREFIX)) or (
                inspect.isfunction(value) and value.__module__ == keys.__name__):
            out[name] = value
    return out


def _declared() -> list[object]:
    return [f for group in keys.SLOT_GROUPS.values() for f in group] + list(keys.SINGLE_KEY)


def test_every_key_family_is_declared_once():
    declared = _declared()
    for name, family in _families().items():
        assert sum(f is family or f == family for f in declared) == 1, \
            f"{name}: declare it once, in redis_keys.SLOT_GROUPS or SINGLE_KEY"
    assert len(declared) == len(_families())


def _keys_of(family, selector: str) -> list[str]:
    """The keys of ``family`` in the group that ``selector`` names: a constant is itself; a function's
    first argument is the selector, any others vary."""
    if isinstance(family, str):
        return [family]
    rest = len(inspect.signature(family).parameters) - 1
    return [family(selector, *[other] * rest) for other in ("w1", "rpm", "x:y{z}", "quota")]


def _tag(key: str) -> str:
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1:end] if start >= 0 and end > start + 1 else ""


@pytest.mark.parametrize("group", sorted(keys.SLOT_GROUPS))
def test_each_group_lives_in_one_slot(group):
    families = keys.SLOT_GROUPS[group]
    indexed = any(isinstance(f, str) for f in families)  # a directory: every record beside its index
    slots_seen = set()
    for selector in NAMES:
        found = [k for f in families for k in _keys_of(f, selector)]
        assert all(_tag(k) for k in found), f"{group}: a key without a hash tag among {found}"
        slots = {key_slot(k.encode()) for k in found}
        assert len(slots) == 1, f"{group} for {selector!r}: {len(slots)} slots for {found}"
        slots_seen |= slots
    if indexed:
        assert len(slots_seen) == 1, f"{group}: its records must share the index's slot"


def test_the_names_of_distinct_groups_stay_distinct():
    """The tag replaces no part of the name: two models (or tenants) never share a key."""
    for group, families in keys.SLOT_GROUPS.items():
        for family in families:
            if isinstance(family, str):
                continue
            made = [k for selector in NAMES for k in _keys_of(family, selector)[:1]]
            assert len(set(made)) == len(NAMES), f"{group}: {family.__name__} names two selectors alike"


def test_the_operations_that_span_families_pair_them_in_one_slot():
    """The multi-key operations, as the code issues them: a job moved from a worker's private stream to the
    shared one, or dead-lettered (MULTI); both read in one XREADGROUP or script; a heartbeat's record and
    index (MULTI); a directory read whole (MGET); a tenant's three limit counters (Lua)."""
    for model in NAMES:
        private, shared = keys.prefill_worker_stream(model, "w1"), keys.prefill_stream(model)
        assert key_slot(private.encode()) == key_slot(shared.encode()) == key_slot(
            keys.dead_letter_stream(model).encode())
    for index, record in ((keys.WORKERS_INDEX, keys.worker_key), (keys.MODELS_INDEX, keys.model_key),
                          (keys.REGISTRY_INDEX, keys.registry_key), (keys.TENANTS_INDEX, keys.tenant_key),
                          (keys.API_KEYS_INDEX, keys.api_key_key)):
        assert {key_slot(k.encode()) for k in [index, *(record(n) for n in NAMES)]} == {key_slot(index.encode())}
    for tenant in ("acme", "a.b-c", "x" * 64):
        assert len({key_slot(keys.limit_key(tenant, kind).encode()) for kind in ("rpm", "tpm", "quota")}) == 1
