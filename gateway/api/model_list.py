"""``GET /v1/models``: the models a client can be served by now, by the names it uses."""

import redis
from aiohttp import web

from kvrelay.gateway.control.served import served
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.tenancy.auth import TENANT


async def list_models(request: web.Request) -> web.Response:
    """The models a request can be served by now (loaded, or registered and loaded by their first
    request), by the name clients use; never an instance key."""
    try:
        view = await served(request.app)
    except redis.RedisError as exc:
        raise APIError(503, f"model registry unavailable: {exc}", code="registry_unavailable") from None
    tenant = request[TENANT]
    data = []
    for name in sorted(n for n in view.known if view.servable(n) and tenant.may_use(n)):
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "kvrelay", "root": name, "parent": None}
        spec = view.specs.get(name)
        info = view.models.get(spec.instance if spec else name)
        max_len = info.max_model_len if info else spec.max_model_len if spec else 0
        if max_len:
            entry["max_model_len"] = max_len
        if spec is not None and spec.version:
            entry["version"] = spec.version
        data.append(entry)
    return web.json_response({"object": "list", "data": data})
