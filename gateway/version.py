"""``GET /version``: ``{"version": ...}`` as vLLM answers it, with kvrelay's version (the installed
package's), so clients and deploy checks that ask vLLM what it runs get an answer. Open like the probes:
it says nothing a tenant key protects."""

import functools
from importlib import metadata

from aiohttp import web


@functools.cache
def kvrelay_version() -> str:
    try:
        return metadata.version("kvrelay")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": kvrelay_version()})
