"""Every Redis key, stream, group and channel name kvrelay uses, and the timing constants that go
with them. Values stored under these keys are ``shared.wire.protocol`` messages (msgpack bytes).

    prefill_stream(model)     stream; gateway XADDs {JOB_FIELD: encode(Job)}; prefill workers read it
                              through consumer group PREFILL_GROUP (create it with id "0" + MKSTREAM so
                              jobs queued before the first worker are not skipped)
    prefill_band_stream(m, b) stream; like prefill_stream, for the jobs of priority band b != 0 of a model
                              served under --scheduling-policy priority (priority_bands.py); band 0 is
                              prefill_stream itself. Read through PREFILL_GROUP, best band first
    prefill_worker_stream(m, w) stream; like prefill_stream but routed to one worker (prefix affinity); read
                              by it through PREFILL_GROUP, adopted by peers once its worker_key is gone
    dead_letter_stream(model) stream; jobs delivered more than MAX_DELIVERIES times, same field
    worker_key(worker_id)     string, encode(WorkerInfo), SET with EX=HEARTBEAT_TTL_S every
                              HEARTBEAT_INTERVAL_S; the id is also SADDed to WORKERS_INDEX
    model_key(name)           string, encode(ModelInfo), EX=MODEL_TTL_S renewed by every heartbeat of a
                              worker that holds it; the name is SADDed to MODELS_INDEX
    ABORT_CHANNEL             pub/sub; gateway PUBLISHes encode(Abort); every worker subscribes
    gateway_key(reply_addr)   string, the gateway's id, SET with EX=GATEWAY_TTL_S every
                              GATEWAY_HEARTBEAT_S by each gateway, keyed by the ZMQ PULL address its Jobs
                              carry as reply_addr; a worker aborts the requests whose gateway's key lapsed

Models (an "instance" is one model at one version, ``protocol.instance_key``: "name@3", or "name" for a
model given by path; streams, ModelInfo and WorkerInfo.models use instance keys):
    registry_key(name)        string, encode(ModelSpec): the desired state; name SADDed to REGISTRY_INDEX
    control_key(worker_id)    list; the gateway LPUSHes encode(ControlCommand), the worker RPOPs them
    control_result_key(cid)   string, encode(ControlResult), EX CONTROL_RESULT_TTL_S
    load_lock_key(instance)   string SET NX EX LOAD_LOCK_TTL_S by the gateway placing a load, so
                              concurrent requests on several gateways start one load, not many
    RECONCILE_LOCK            string SET NX EX: the one gateway reconciling the registry this round
    rerun_key(job, worker)    string SET NX EX by whichever of the gateway and the prefill worker first sees
                              the decode worker ``worker`` die holding the job in the window where both may
                              re-run it (it told the gateway, the prefill side never got its ack): only the
                              one that set it runs the job again (shared/wire/rerun.py)

Tenants (gateway only; plain hash fields, not protocol messages, so operators can read them):
    TENANTS_INDEX             set of tenant names; non-empty means every API request needs a key
    tenant_key(name)          hash: models (JSON list, [] = all), rpm, tpm, quota_tokens, quota_period_s,
                              priority, cache_salt, created; an absent limit field means unlimited
    API_KEYS_INDEX            hash: key id -> sha256 hex of the key (to revoke and list by id)
    api_key_key(digest)       hash: id, tenant, digest, created. The key itself is never stored
    limit_key(tenant, kind)   kind "rpm"/"tpm": hash unix second -> requests/tokens admitted in it,
                              a 60 s sliding window; kind "quota": hash period index -> tokens. The
                              {tenant} hash tag keeps one tenant's limit keys in one cluster slot
    usage_key(t, model, min)  hash: requests, prompt_tokens, completion_tokens, cache_hits of one unix
                              minute, TTL'd; USAGE_TENANTS and usage_models_key(t) index them
    response_cache_key(t, h)  string: a cached response body for request hash h, TTL'd

Metrics:
    METRICS_SALT              string, random hex SET NX by the first gateway or worker to start: what a
                              tenant's name is hashed with in /metrics (shared/wire/tenant_label.py)

Redis Cluster: what one operation touches together (a MULTI, a Lua script, a multi-key command) shares
a hash tag, ``{...}`` in the name, so it lives in one slot (``SLOT_GROUPS``): a model instance's streams
(``{instance}``), each directory with its index (workers, models, registry, tenants, API keys: small,
read whole with one MGET or written with their index in one MULTI), a tenant's limit counters
(``{tenant}``). ``SINGLE_KEY`` families are only ever touched one key per command, script or MULTI;
untagged, they spread over the cluster. Names from before the tags: ``legacy_keys.py``.
"""

import hashlib

PREFIX = "kvrelay"

PREFILL_GROUP = f"{PREFIX}-prefill"
JOB_FIELD = "data"
WORKERS_INDEX = f"{PREFIX}:{{workers}}"
MODELS_INDEX = f"{PREFIX}:{{models}}"
ABORT_CHANNEL = f"{PREFIX}:abort"
METRICS_SALT = f"{PREFIX}:metrics-salt"

HEARTBEAT_INTERVAL_S = 2.0
# Several missed heartbeats before a worker counts as dead: a GC pause or a long prefill step must not
# make the gateway answer 503.
HEARTBEAT_TTL_S = 10
# A model record outlives the last worker holding it by this much: a worker restarting keeps its model
# known (503 and Retry-After, not 404), and a deployment that is gone leaves no name behind for good.
MODEL_TTL_S = 300
# Gateways beat as workers do: a gateway killed with -9 stops beating, and within GATEWAY_TTL_S the
# workers free its requests' decode seats and KV instead of decoding for nobody until max_tokens.
GATEWAY_HEARTBEAT_S = 1.0
GATEWAY_TTL_S = 5
# A job that made this many workers fail is poison; it goes to the dead-letter stream, not round again.
MAX_DELIVERIES = 3
# Approximate cap (XADD MAXLEN ~) so an idle model's stream cannot grow without bound.
STREAM_MAXLEN = 100_000


REGISTRY_INDEX = f"{PREFIX}:{{registry}}"
RECONCILE_LOCK = f"{PREFIX}:reconcile-lock"
CONTROL_RESULT_TTL_S = 600
LOAD_LOCK_TTL_S = 120


def _tag(value: str) -> str:
    """``{value}``: the hash tag putting every key named by ``value`` in one cluster slot. Redis hashes
    what lies between the first ``{`` and the next ``}``, so a value holding a brace is tagged by its
    digest instead, followed by the value itself, which keeps the names distinct."""
    if "{" not in value and "}" not in value and value:
        return f"{{{value}}}"
    return f"{{#{hashlib.sha256(value.encode()).hexdigest()[:16]}}}{value}"


def registry_key(name: str) -> str:
    return f"{REGISTRY_INDEX}:{name}"


def control_key(worker_id: str) -> str:
    return f"{PREFIX}:control:{worker_id}"


def control_result_key(command_id: str) -> str:
    return f"{PREFIX}:control-result:{command_id}"


def load_lock_key(instance: str) -> str:
    return f"{PREFIX}:load-lock:{instance}"


def prefill_stream(model: str) -> str:
    return f"{PREFIX}:prefill:{_tag(model)}"


def prefill_band_stream(model: str, band: int) -> str:
    # after the tag, so a band stream shares its model's slot and no model's name can spell it
    return f"{prefill_stream(model)}:band:{band}"


def prefill_worker_stream(model: str, worker_id: str) -> str:
    # the tag ends where the model's name does, so (model, worker) pairs stay apart when either holds a ":"
    return f"{PREFIX}:prefill-worker:{_tag(model)}:{worker_id}"


def dead_letter_stream(model: str) -> str:
    return f"{PREFIX}:deadletter:{_tag(model)}"


def worker_key(worker_id: str) -> str:
    return f"{WORKERS_INDEX}:{worker_id}"


def gateway_key(reply_addr: str) -> str:
    return f"{PREFIX}:gateway:{reply_addr}"


def rerun_key(job_id: str, worker_id: str) -> str:
    return f"{PREFIX}:rerun:{job_id}:{worker_id}"


def model_key(name: str) -> str:
    return f"{MODELS_INDEX}:{name}"


TENANTS_INDEX = f"{PREFIX}:{{tenants}}"
API_KEYS_INDEX = f"{PREFIX}:{{apikeys}}"
USAGE_TENANTS = f"{PREFIX}:usage-tenants"


def tenant_key(name: str) -> str:
    return f"{TENANTS_INDEX}:{name}"


def api_key_key(digest: str) -> str:
    return f"{API_KEYS_INDEX}:{digest}"


def limit_key(tenant: str, kind: str) -> str:
    return f"{PREFIX}:limit:{_tag(tenant)}:{kind}"


def usage_key(tenant: str, model: str, minute: int) -> str:
    return f"{PREFIX}:usage:{tenant}:{model}:{minute}"


def usage_models_key(tenant: str) -> str:
    return f"{PREFIX}:usage-models:{tenant}"


def response_cache_key(tenant: str, digest: str) -> str:
    return f"{PREFIX}:respcache:{tenant}:{digest}"


# Each group: the families one operation may touch together, by the argument that names the group (a
# function's first one; a constant stands alone). tests/unit/test_redis_slots.py checks that each group
# maps to one slot and that every family is declared here or in SINGLE_KEY.
SLOT_GROUPS: dict[str, tuple] = {
    "instance streams": (prefill_stream, prefill_band_stream, prefill_worker_stream, dead_letter_stream),
    "workers": (WORKERS_INDEX, worker_key),
    "models": (MODELS_INDEX, model_key),
    "registry": (REGISTRY_INDEX, registry_key),
    "tenants": (TENANTS_INDEX, tenant_key),
    "api keys": (API_KEYS_INDEX, api_key_key),
    "tenant limits": (limit_key,),
}
SINGLE_KEY: tuple = (gateway_key, control_key, control_result_key, load_lock_key, RECONCILE_LOCK, usage_key,
                     usage_models_key, USAGE_TENANTS, response_cache_key, METRICS_SALT, rerun_key)
