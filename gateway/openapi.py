"""``GET /openapi.json`` and ``GET /admin/openapi.json``: the API description, from openapi.yaml beside
this file."""

import functools
from pathlib import Path

import yaml
from aiohttp import web


@functools.cache
def _openapi() -> dict:
    return yaml.safe_load((Path(__file__).parent / "openapi.yaml").read_text())


async def openapi(request: web.Request) -> web.Response:
    """The public API; the admin paths are described only to the admin (``/admin/openapi.json``)."""
    doc = _openapi()
    return web.json_response({**doc, "paths": {p: ops for p, ops in doc["paths"].items() if not p.startswith("/admin")}})


async def admin_openapi(request: web.Request) -> web.Response:
    return web.json_response(_openapi())
