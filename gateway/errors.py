"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure —
our own, aiohttp's (404, 405, 413) and unexpected exceptions alike — and the ``X-Request-Id`` header.
"""

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable

import redis
from aiohttp import web

from kvrelay.gateway.redis_watch import redis_failed

log = logging.getLogger("kvrelay.gateway")

# OpenAI's error "type" per HTTP status; clients branch on these.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, bounded: it is echoed back
REQUEST_ID = web.RequestKey("request_id", str)
# unix seconds the request reached the gateway's handlers: its TTFT and deadline count from here, so the time
# its body takes to read, its key to check and its prompt to prepare is in them (a busy loop shows there)
ARRIVAL = web.RequestKey("arrival", float)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None, close: bool = False):
        """``close``: the connection is closed after the answer (a body left half read cannot be skipped)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}
        self.close = close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


class ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int) -> APIError:
    return APIError(503, message, code="no_capacity", headers={"Retry-After": str(retry_after)})


def _from_http_exception(exc: web.HTTPException) -> APIError:
    messages = {
        404: "The requested URL was not found",
        405: "Method not allowed for this URL",
        413: exc.text or "Request body too large",
    }
    message = messages.get(exc.status, exc.reason)
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
    return APIError(exc.status, message, code=codes.get(exc.status), headers=headers)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Stamp the arrival, assign the request id, then turn whatever a handler raises into an OpenAI error body."""
    request[ARRIVAL] = time.time()
    client_id = request.headers.get(REQUEST_ID_HEADER, "")
    request[REQUEST_ID] = client_id if _CLIENT_ID.match(client_id) else uuid.uuid4().hex
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except ClientGone:
        return web.Response(status=499, text="client closed request")  # nginx's code; nobody reads it
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through untouched
            raise
        return _from_http_exception(exc).response()
    except redis.RedisError as exc:
        # Redis down or restarting (the registry, the queue): retryable, and it must not look like a bug;
        # an outage is logged once by the Redis watch, not once per request
        if not redis_failed(request.app, exc):
            log.warning("redis error on %s %s: %s", request.method, request.path, exc)
        return APIError(503, "the request queue is unavailable; retry later", code="queue_unavailable",
                        headers={"Retry-After": "1"}).response()
    except (ConnectionResetError, web.RequestPayloadError) as exc:
        # The client went away mid-body; nobody will read an answer, but keep the log quiet.
        log.info("client connection lost: %s", exc)
        return APIError(400, "connection lost while reading the request").response()
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, "internal server error", code="internal_error").response()


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare signal: covers streamed responses too, whose headers go out early."""
    request_id = request.get(REQUEST_ID)
    if request_id:
        response.headers[REQUEST_ID_HEADER] = request_id
