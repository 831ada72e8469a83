"""Every request field either changes what a real model answers or is a 400 (issue #13, item 4): the table
of tests/e2e/request_fields_table.py checked against the schemas, and each of its Effect and Rejected entries
asked of SmolLM2 served by a real gateway and worker."""

import json
import re
import typing
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from kvrelay.gateway.api.schemas import UNSUPPORTED_FIELDS
from tests.e2e.request_fields import BASE, ok, post, text
from tests.e2e.request_fields_table import FIELDS, SCHEMAS, Effect, Elsewhere, Rejected


def schema_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        name = info.alias or name  # a field whose name Python reserves ("schema", "json"): the API's name
        out.add(prefix + name)
        for nested, many in _nested(info.annotation):
            out |= schema_fields(nested, f"{prefix}{name}{'[]' if many else ''}.")
    return out


def _nested(tp: Any, many: bool = False):
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, many
        return
    for arg in typing.get_args(tp):
        yield from _nested(arg, many or typing.get_origin(tp) is list)


def _cases(kind: type) -> list:
    return [pytest.param(endpoint, name, cov, id=f"{endpoint}:{name}")
            for endpoint, table in FIELDS.items() for name, cov in table.items() if isinstance(cov, kind)]


@pytest.mark.parametrize("endpoint", list(SCHEMAS))
def test_every_schema_field_is_in_the_table(endpoint):
    want = schema_fields(SCHEMAS[endpoint]) | set(UNSUPPORTED_FIELDS)
    have = set(FIELDS[endpoint])
    assert not want - have, f"{endpoint}: fields with no coverage entry in FIELDS: {sorted(want - have)}"
    assert not have - want, f"{endpoint}: FIELDS names fields the schema lacks: {sorted(have - want)}"
    root = Path(__file__).parents[2]
    for name, cov in FIELDS[endpoint].items():
        if isinstance(cov, Elsewhere):
            path, func = cov.test.split("::")
            assert re.search(rf"^def {func}\(", (root / path).read_text(), re.M), f"{name}: {cov.test} is gone"


_BASELINES: dict[str, httpx.Response] = {}


def baseline(client: httpx.Client, body: dict) -> httpx.Response:
    """Every baseline is greedy or seeded, so the same body answers the same: each is asked once (most
    fields share one, and every request is a real model's CPU time)."""
    key = json.dumps(body, sort_keys=True)
    if key not in _BASELINES:
        _BASELINES[key] = ok(client, body)
    return _BASELINES[key]


@pytest.mark.parametrize("endpoint, name, cov", _cases(Effect))
def test_effect(fields_http, endpoint, name, cov: Effect):
    base = {**BASE[endpoint], **cov.base}
    without = cov.observe(baseline(fields_http, base))
    with_field = cov.observe(ok(fields_http, {**base, **cov.change}))
    assert with_field != without, f"{name} set or not, the answer reads {without!r}"


@pytest.mark.parametrize("endpoint, name, cov", _cases(Rejected))
def test_rejected(fields_http, endpoint, name, cov: Rejected):
    r = post(fields_http, {**BASE[endpoint], **cov.body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == (cov.param or name), error


def test_unsupported_fields_at_their_off_value_are_accepted(fields_http):
    off = {"response_format": {"type": "text"}, "tools": [], "best_of": 1, "use_beam_search": False,
           "guided_decoding_backend": "auto"}
    assert text(ok(fields_http, {**BASE["completions"], **off})) == text(ok(fields_http, BASE["completions"]))
