"""The API room on the app: its cleanup context puts the response cache, on the app's Redis, under
``RESPONSE_CACHE``. The tokenizers (``TOKENIZERS``) need no Redis and live as long as the app
(``create_app``)."""

from collections.abc import AsyncIterator

from aiohttp import web

from kvrelay.gateway.api.response_cache import RESPONSE_CACHE, ResponseCache
from kvrelay.gateway.redis_watch import REDIS_WATCH
from kvrelay.gateway.state import CONFIG, REDIS


async def api_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    app[RESPONSE_CACHE] = ResponseCache(app[REDIS], config.response_cache_ttl, config.response_cache_max_bytes,
                                        app[REDIS_WATCH].health)
    yield
