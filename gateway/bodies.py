"""Request bodies as every room reads them: the raw body to JSON (``read_json``) and JSON to a pydantic
model (``validate``), each problem a 400 in OpenAI's shape naming the field, a body that does not arrive
within ``--timeout-body-read`` a 408."""

import asyncio
import json
import math
import re
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.gateway.state import CONFIG

T = TypeVar("T", bound=BaseModel)


# Pydantic names union branches in error locations ("prompt.str", "prompt.list[int].1"); a client wants
# the field and what it accepts instead.
_BRANCH = re.compile(r"^(str|int|float|bool|none|dict\[.*\]|list\[.*\]|[A-Z]\w*)$")
_ACCEPTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def _validation_error(exc: ValidationError) -> Exception:
    first = exc.errors()[0]
    path: list[str] = []
    union = False
    for part in first["loc"]:
        if isinstance(part, str) and _BRANCH.match(part):
            union = True
            break
        path.append(str(part))
    loc = ".".join(path)
    if union and path and path[-1] in _ACCEPTS:
        message = f"{loc} must be {_ACCEPTS[path[-1]]}"
    else:
        message = f"{loc}: {first['msg']}" if loc else first["msg"]
    return bad_request(message, param=loc or None)


def validate(model_cls: type[T], body: Any) -> T:
    """Validate a decoded JSON body, strictly (no coercion: "2" is not 2, 1 is not true, in nested models too);
    the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    # OpenAI's fields are "number or null" and friends, null meaning "the default": the openai SDK sends a
    # None it is given as null. Dropped, the field is unset, so the model's generation_config still applies.
    body = {k: v for k, v in body.items() if v is not None or k not in model_cls.model_fields}
    try:
        return model_cls.model_validate(body, strict=True)
    except ValidationError as exc:
        raise _validation_error(exc) from None


class _NonFinite:
    """What json.loads is given to note non-finite numbers: Python's json accepts NaN and Infinity, which JSON
    does not, and reads 1e400 as inf; either slips past range checks (NaN < 2 is False, and so is NaN > 2)."""

    def __init__(self) -> None:
        self.seen = False

    def constant(self, name: str) -> float:
        self.seen = True
        return float(name)

    def number(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            self.seen = True
        return value


def _non_finite_path(obj: Any, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """Where the first non-finite float is, as the field's path (``messages.0.content``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return path
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in children:
        found = _non_finite_path(value, (*path, str(key)))
        if found is not None:
            return found
    return None


def _reject_non_finite(body: Any) -> None:
    path = _non_finite_path(body)
    if path is None:
        return
    if not path:
        raise bad_request("request body is not valid JSON: not a finite number")
    field = ".".join(path)
    raise bad_request(f"{field} must be a finite number (NaN, Infinity and numbers past 1.8e308 are not)", field)


# A \uD800-\uDFFF escape: JSON lets a string hold a lone surrogate, which no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone_surrogate(obj: Any) -> bool:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v) for v in obj)
    return False


async def read_body(request: web.Request) -> bytes:
    """The raw body; 408 and the connection closed when it takes longer than --timeout-body-read (a client
    trickling it, or one that declared a Content-Length it never sends, would hold the connection forever)."""
    timeout = request.app[CONFIG].timeout_body_read
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_read_timeout",
                       close=True) from None


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 413 past max_body_size (aiohttp's client_max_size), 408 past --timeout-body-read,
    400 for bad UTF-8 or JSON, or a non-finite number (naming its field)."""
    raw = await read_body(request)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    non_finite = _NonFinite()
    try:
        body = json.loads(text, parse_constant=non_finite.constant, parse_float=non_finite.number)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:  # [[[[...]]]]: nesting deeper than Python's parser goes
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # an integer literal past Python's digit limit
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    try:
        lone = _SURROGATE_ESCAPE.search(text) is not None and _has_lone_surrogate(body)
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    if lone:
        raise bad_request("request body is not valid JSON: a string holds an unpaired UTF-16 surrogate")
    if non_finite.seen:
        try:
            _reject_non_finite(body)
        except RecursionError:
            raise bad_request("request body is not valid JSON: nested too deeply") from None
    return body


async def read_api_json(request: web.Request) -> Any:
    """``read_json`` for the OpenAI routes, which take JSON only: a body declared as something else (a form,
    as ``curl -d`` sends by default) is a 415, as vLLM answers; a body with no Content-Type is read as JSON."""
    declared = request.headers.get("Content-Type")
    if declared is not None and not _is_json(declared):
        raise APIError(415, f"Content-Type must be application/json, got {declared.split(';')[0].strip()!r}",
                       code="unsupported_media_type")
    return await read_json(request)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
