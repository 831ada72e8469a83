"""``GET /v1/models``: the models a request is served for, by the names clients use."""

import redis
from aiohttp import web

from kvrelay.gateway.control.served import served
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.tenancy.auth import TENANT


async def list_models(request: web.Request) -> web.Response:
    """Exactly the names a request of this caller is served for (``Served.listed``, what request
    resolution decides from): the registered ones, loaded or not (a request loads them), and those live
    workers publish directly; never an instance key, nor a model the caller's key may not use, nor one whose
    live workers of a phase are all stalled (its request gets 503 until they step again). kvrelay's
    own ``kvrelay`` field says whether live workers hold it now (``loaded``: no load before the first token)
    and whether it is registered (loaded on demand)."""
    try:
        view = await served(request.app)
        if view.lacks_startup():
            # the cached view may predate what another gateway process's /ready said 200 from (each caches its
            # own reading for --registry-cache-s): a model serve started is read again before it is left out
            view = await served(request.app, fresh=True)
    except redis.RedisError as exc:
        raise APIError(503, f"model registry unavailable: {exc}", code="registry_unavailable") from None
    tenant = request[TENANT]
    data = []
    for name in (n for n in view.listed() if tenant.may_use(n)):
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "kvrelay", "root": name, "parent": None}
        spec = view.specs.get(name)
        info = view.info(name)
        max_len = info.max_model_len if info else spec.max_model_len if spec else 0
        if max_len:
            entry["max_model_len"] = max_len
        if spec is not None and spec.version:
            entry["version"] = spec.version
        entry["kvrelay"] = {"loaded": view.loaded(name), "registered": spec is not None}
        data.append(entry)
    return web.json_response({"object": "list", "data": data})
