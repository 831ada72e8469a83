"""The admin API's model handlers (admin key only, ``tenancy/auth.py``; routed in ``routes.py`` beside the rooms):

    GET    /admin/models                 per model, instance and worker: state, version, memory, KV use,
                                         queue depth (XLEN of the instance's streams, each priority
                                         band's); plus the workers (with their wire protocol versions,
                                         and whether their engine loop is stalled: stalled_workers.py)
                                         and those refused
    POST   /admin/models                 register {name, version?, dtype, quantization?, kv_cache_dtype?,
                                         max_model_len, pinned, min_replicas, keep_alive_s}: 201, or 200
                                         when updating hints;
                                         pinned / min_replicas > 0 start loading at once
    DELETE /admin/models/{name}          unregister, and unload (drain) every version everywhere
    POST   /admin/models/{name}/load     load now and wait until servable: 200, or 503 with the reason
    POST   /admin/models/{name}/unload   {drain?}: 202, the workers drain and unload
    POST   /admin/models/{name}/swap     {version}: load it where the active one is, flip when ready,
                                         drain the old one; 200 with the new spec

Only repository names and versions come in: no path, no URL (the body schema forbids other fields), and
every name goes through the repository's confinement (``..``, absolute paths, escaping symlinks: 400).
"""

import asyncio
import dataclasses
import logging
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvrelay.gateway.bodies import read_json, validate
from kvrelay.gateway.control.model_registry import MODEL_REGISTRY, SpecConflict, served_name
from kvrelay.gateway.control.placement import PLACEMENT, LoadError, instance_state
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY
from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.gateway.state import CONFIG, REDIS, spawn
from kvrelay.shared.repo.model_repo import NAME_RE, ModelRepository, ModelVersion, RepositoryError
from kvrelay.shared.wire.priority_bands import shared_streams
from kvrelay.shared.wire.protocol import InstanceStatus, ModelSpec, WorkerInfo, instance_key
from kvrelay.shared.wire.version import PROTOCOL_VERSION

log = logging.getLogger("kvrelay.gateway")

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["fp8", "int8", "awq", "gptq"]  # vLLM's names (shared/config/engine.py)
# Only set with --model-repo: registrations are checked against it (app.get(MODEL_REPO)).
MODEL_REPO = web.AppKey("model_repo", ModelRepository)


class RegisterBody(BaseModel):
    # extra="forbid": a "path" or "url" is refused, not ignored; only repository versions are loaded
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=128)
    version: StrictInt | None = Field(default=None, ge=1)  # None: the one registered, else the newest
    dtype: Dtype = "auto"
    quantization: Quantization | None = None  # None: the workers' --quantization, else the checkpoint's
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] | None = None  # None: the workers' --kv-cache-dtype
    max_model_len: StrictInt = Field(default=0, ge=0)
    pinned: StrictBool = False
    min_replicas: StrictInt = Field(default=0, ge=0, le=64)
    keep_alive_s: float = Field(default=0.0, ge=0, le=30 * 86400)


class SwapBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: StrictInt = Field(ge=1)


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    drain: StrictBool = True


def _retry(request: web.Request) -> dict[str, str]:
    return {"Retry-After": str(request.app[CONFIG].retry_after_s)}


def _name(request: web.Request) -> str:
    name = request.match_info["name"]
    if not NAME_RE.match(name):
        raise bad_request(f"model name {name!r} must match {NAME_RE.pattern}", "name")
    return name


async def _optional_body(request: web.Request) -> dict:
    return await read_json(request) if request.can_read_body else {}


async def _repo_version(request: web.Request, name: str, version: int | None) -> ModelVersion:
    repo = request.app.get(MODEL_REPO)
    if repo is None:
        raise bad_request("registering models needs the gateway started with --model-repo", "name",
                          code="model_repo_unconfigured")
    try:
        # a thread: a repository on network storage must not stall every stream
        return await asyncio.to_thread(repo.get, name, version)
    except (ValueError, TypeError, OSError) as exc:  # RepositoryError, and a manifest that does not parse
        param = "version" if isinstance(exc, RepositoryError) and "version" in str(exc) else "name"
        raise bad_request(str(exc), param, code="invalid_model") from None


async def _registered(request: web.Request, name: str) -> ModelSpec:
    spec = await request.app[MODEL_REGISTRY].spec(name)
    if spec is None:
        raise APIError(404, f"model {name!r} is not registered", param="name", code="model_not_found")
    return spec


def _spec_json(spec: ModelSpec) -> dict:
    return {"object": "model_spec", **dataclasses.asdict(spec), "instance": spec.instance}


async def register_model(request: web.Request) -> web.Response:
    body = validate(RegisterBody, await read_json(request))
    models = request.app[MODEL_REGISTRY]
    existing = await models.spec(body.name) if NAME_RE.match(body.name) else None
    mv = await _repo_version(request, body.name, body.version or (existing.version if existing else None))
    if existing is not None and existing.version != mv.version:
        raise APIError(409, f"{body.name} is registered at version {existing.version}; change versions with "
                            f"POST /admin/models/{body.name}/swap", param="version", code="use_swap")
    if body.max_model_len > mv.max_model_len:
        raise bad_request(f"max_model_len {body.max_model_len} exceeds the model's {mv.max_model_len}",
                          "max_model_len")
    spec = ModelSpec(name=mv.name, version=mv.version, dtype=body.dtype, quantization=body.quantization or "",
                     kv_cache_dtype=body.kv_cache_dtype or "",
                     max_model_len=body.max_model_len,
                     pinned=body.pinned, min_replicas=body.min_replicas, keep_alive_s=body.keep_alive_s,
                     previous_version=existing.previous_version if existing else 0)
    await models.put(spec)
    loading = spec.pinned or spec.min_replicas > 0
    if loading:  # in the background: a big model loads longer than an HTTP client waits
        spawn(request.app, _load_quietly(request.app, spec))
    log.info("model %s %s at version %d", spec.name, "updated" if existing else "registered", spec.version)
    return web.json_response({**_spec_json(spec), "loading": loading}, status=200 if existing else 201)


async def _load_quietly(app: web.Application, spec: ModelSpec) -> None:
    try:
        await app[PLACEMENT].ensure_loaded(spec, app[CONFIG].model_load_timeout, replicas=max(1, spec.min_replicas))
    except LoadError as exc:  # the reconciler tries again
        log.warning("loading %s at registration failed: %s", spec.instance, exc)


async def _versions_held(request: web.Request, name: str) -> set[int]:
    registry = request.app[WORKER_REGISTRY]
    published = await registry.models(fresh=True)
    return {s.version for w in await registry.workers(fresh=True) for s in _statuses(w, published) if s.name == name}


async def delete_model(request: web.Request) -> web.Response:
    name = _name(request)
    spec = await _registered(request, name)
    await request.app[MODEL_REGISTRY].delete(name)
    versions = await _versions_held(request, name) | {spec.version}
    unloads = [u for v in sorted(versions) for u in await request.app[PLACEMENT].unload(name, v, drain=True)]
    log.info("model %s unregistered; unloading %s", name, [u["instance"] for u in unloads])
    return web.json_response({"object": "model_spec", "name": name, "deleted": True, "unloads": unloads})


async def load_model(request: web.Request) -> web.Response:
    name = _name(request)
    spec = await _registered(request, name)
    try:
        await request.app[PLACEMENT].ensure_loaded(spec, request.app[CONFIG].model_load_timeout,
                                                   replicas=max(1, spec.min_replicas), retry=True)
    except LoadError as exc:
        raise APIError(503, f"model `{name}` could not be loaded: {exc}", code="model_unavailable",
                       headers=_retry(request)) from None
    workers = [w.worker_id for w in await request.app[WORKER_REGISTRY].workers(fresh=True)
               if instance_state(w, spec.instance) == "ready"]
    return web.json_response({"object": "model_load", "name": name, "instance": spec.instance, "workers": workers})


async def unload_model(request: web.Request) -> web.Response:
    name = _name(request)
    body = validate(UnloadBody, await _optional_body(request))
    spec = await request.app[MODEL_REGISTRY].spec(name)
    if spec is not None and (spec.pinned or spec.min_replicas > 0):
        raise APIError(409, f"{name} is pinned or keeps replicas (the reconciler would load it again); "
                            f"re-register it without, or DELETE it", code="model_pinned")
    versions = await _versions_held(request, name)
    if spec is None and not versions:
        raise APIError(404, f"no worker holds a model named {name!r}", param="name", code="model_not_found")
    unloads = [u for v in sorted(versions) for u in await request.app[PLACEMENT].unload(name, v, body.drain)]
    return web.json_response({"object": "model_unload", "name": name, "unloads": unloads}, status=202)


async def swap_model(request: web.Request) -> web.Response:
    name = _name(request)
    body = validate(SwapBody, await read_json(request))
    spec = await _registered(request, name)
    await _repo_version(request, name, body.version)
    if body.version == spec.version:
        return web.json_response({**_spec_json(spec), "swapped": False, "unloads": []})
    config = request.app[CONFIG]
    # other gateways read specs through a cache this old: the old version keeps serving until they follow
    grace_s = max(0.5, 2 * config.registry_cache_s)
    try:
        flipped, unloads = await request.app[PLACEMENT].swap(request.app[MODEL_REGISTRY], spec, body.version,
                                                             config.model_load_timeout, grace_s)
    except LoadError as exc:
        raise APIError(503, f"swap of `{name}` to version {body.version} failed: {exc}", code="model_unavailable",
                       headers=_retry(request)) from None
    except SpecConflict as exc:
        raise APIError(409, str(exc), code="conflict") from None
    return web.json_response({**_spec_json(flipped), "swapped": True, "unloads": unloads})


def _statuses(worker: WorkerInfo, published: dict) -> list[InstanceStatus]:
    """A worker's instances; one started with --model reports only ``models``, which are ready."""
    statuses = list(worker.instances)
    reported = {s.instance for s in statuses}
    for instance in worker.models:
        if instance not in reported:
            info = published.get(instance)
            statuses.append(InstanceStatus(instance=instance, name=served_name(info) if info else instance,
                                           version=info.version if info else 0, state="ready"))
    return statuses


async def list_models(request: web.Request) -> web.Response:
    registry = request.app[WORKER_REGISTRY]
    workers = await registry.workers(fresh=True)
    published = await registry.models(fresh=True)
    specs = await request.app[MODEL_REGISTRY].specs(fresh=True)
    entries: dict[str, dict] = {}

    def entry(name: str) -> dict:
        if name not in entries:
            spec = specs.get(name)
            hints = dataclasses.asdict(spec) if spec else {"name": name, "version": 0}
            entries[name] = {**hints, "registered": spec is not None, "instances": {}}
        return entries[name]

    def instance(name: str, inst: str, version: int) -> dict:
        return entry(name)["instances"].setdefault(inst, {"instance": inst, "version": version, "workers": []})

    for name, spec in specs.items():
        instance(name, spec.instance, spec.version)
    for info in published.values():
        if info.version == 0 and "@" not in info.name:
            instance(served_name(info), info.name, 0)
    for worker in workers:
        for status in _statuses(worker, published):
            row = dataclasses.asdict(status)
            for key in ("instance", "name", "version"):
                row.pop(key)
            instance(status.name, status.instance, status.version)["workers"].append(
                {"worker_id": worker.worker_id, "role": worker.role, **row})
    rows = [i for e in entries.values() for i in e["instances"].values()]
    pipe = request.app[REDIS].pipeline(transaction=False)
    streams = {row["instance"]: shared_streams(row["instance"]) for row in rows}  # every priority band's
    for row in rows:
        for stream in streams[row["instance"]]:
            pipe.xlen(stream)
    lengths = iter(await pipe.execute())
    for row in rows:
        row["queue_depth"] = sum(next(lengths) for _ in streams[row["instance"]])
    data = []
    for name in sorted(entries):
        e = entries[name]
        active = instance_key(name, e["version"])
        e["instances"] = [{**i, "active": i["instance"] == active} for _, i in sorted(e["instances"].items())]
        data.append({"object": "model", **e})
    pool = [{"worker_id": w.worker_id, "role": w.role, "host": w.host, "can_load": w.can_load,
             "weights_budget": w.weights_budget, "weights_used": w.weights_used, "overhead_used": w.overhead_used,
             "kv_pool_bytes": w.kv_pool_bytes,
             "kv_committed_bytes": w.kv_committed_bytes, "kv_cap_bytes": w.kv_cap_bytes,
             "kv_free_bytes": w.kv_free_bytes, "free_blocks": w.free_blocks, "total_blocks": w.total_blocks,
             "running": w.running, "waiting": w.waiting, "protocol": w.protocol, "step_age_s": w.step_age_s,
             "stalled": w.worker_id in registry.stalls.ages} for w in workers]
    return web.json_response({"object": "list", "data": data, "workers": pool, "protocol": PROTOCOL_VERSION,
                              "refused_workers": registry.refused})
