"""What a request's output must match, from the API's many names for it to the one ``StructuredOutputs``
the engine gets: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and its newer ``structured_outputs`` object, and
(chat) a ``tool_choice`` that forces a call (tool_choice.py builds that schema).

A request sets at most one of them: two would ask for outputs that match both, which no grammar backend
composes, so more than one is a 400 naming them. A JSON Schema is checked here against its metaschema (a
400 naming the field) and serialized canonically (sorted keys, no spaces), so equal schemas written in any
key order reach the engine as the same text and hit its compile cache.

vLLM's knobs on how a grammar is built (``whitespace_pattern``, a per-request backend) are a 400 when they
ask for anything: the engine builds one grammar per constraint, and a knob accepted and ignored would hand
the client other output than it asked for. Two are accepted either way because the engine's grammars
already do what they ask: ``disable_any_whitespace`` (the JSON grammars allow no free whitespace — one
fixed layout, so a small model cannot fill max_tokens with newlines — which is what true asks and what
false permits) and ``disable_additional_properties`` (vLLM's switch to make its llguidance backend leave
out properties a schema does not list, as its xgrammar backend does; the engine's xgrammar compiles
schemas strictly, so an object never gains a property its schema leaves unstated).
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field

from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.shared.wire.structured_outputs import StructuredOutputs


class _Strict(BaseModel):
    # No coercion, and unknown keys refused: a misspelt "shema" must not become an unconstrained request.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=False)


class JsonSchemaFormat(_Strict):
    name: str  # OpenAI's label for the format; required there too
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # true or false, the schema is enforced: the strongest reading of either


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` object (its newer spelling of the ``guided_*`` fields)."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's fallback to another backend when the first cannot compile a constraint: there is one backend,
    # which never falls back, so either value is what happens
    disable_fallback: bool = False
    disable_any_whitespace: bool = False  # the engine's JSON has no free whitespace: see the module's docstring
    disable_additional_properties: bool = False  # what the engine does either way: see the module's docstring
    whitespace_pattern: str | None = None


@dataclass(frozen=True)
class Constraint:
    outputs: StructuredOutputs
    param: str  # the request field that set it: what a 400 about it names


def schema_text(schema: Any, param: str) -> str:
    """A JSON Schema (an object, or a string holding one) checked and serialized canonically."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param)
    try:
        validator_for(schema, default=validator_for({})).check_schema(schema)
    except SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise bad_request(f"{param} is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else ""),
                          param) from None
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _outputs(param: str, **constraint: Any) -> Constraint:
    if constraint.get("regex") is not None:
        try:
            re.compile(constraint["regex"])
        except (re.error, RecursionError) as exc:
            raise bad_request(f"{param} is not a valid regular expression: {exc}", param) from None
    try:
        return Constraint(StructuredOutputs(**constraint), param)
    except ValueError as exc:  # sizes and emptiness, worded for the wire field: name the request's instead
        raise bad_request(f"{param}: {str(exc).split(' ', 1)[1]}", param) from None


def _from_response_format(rf: ResponseFormat) -> Constraint | None:
    if rf.type != "json_schema":
        if rf.json_schema is not None:
            raise bad_request(f"response_format.json_schema is only read with type \"json_schema\", not {rf.type!r}",
                              "response_format.json_schema")
        return None if rf.type == "text" else _outputs("response_format", json_object=True)
    if rf.json_schema is None:
        raise bad_request("response_format of type \"json_schema\" needs json_schema", "response_format.json_schema")
    if rf.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema needs schema (the JSON Schema the output must match)",
                          "response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return _outputs(param, json=schema_text(rf.json_schema.schema_, param))


def _from_structured_outputs(so: StructuredOutputsRequest) -> list[Constraint]:
    if so.whitespace_pattern is not None:
        raise bad_request("structured_outputs.whitespace_pattern is not supported: the engine builds one grammar "
                          "per constraint", "structured_outputs.whitespace_pattern")
    found = []
    if so.json_ is not None:
        param = "structured_outputs.json"
        found.append(_outputs(param, json=schema_text(so.json_, param)))
    for name in ("regex", "choice", "grammar"):
        if getattr(so, name) is not None:
            found.append(_outputs(f"structured_outputs.{name}", **{name: getattr(so, name)}))
    if so.json_object:
        found.append(_outputs("structured_outputs.json_object", json_object=True))
    if not found:
        raise bad_request("structured_outputs must set one of json, regex, choice, grammar or json_object",
                          "structured_outputs")
    return found


def request_constraint(body: Any, forced_call: Constraint | None = None) -> Constraint | None:
    """The one constraint ``body`` (a completions or chat request) sets, or None; ``forced_call``: the
    schema a chat request's tool_choice imposes."""
    if body.guided_decoding_backend not in (None, "auto"):
        raise bad_request("guided_decoding_backend cannot be chosen per request: this server runs one grammar "
                          "backend (\"auto\" or leave it out)", "guided_decoding_backend")
    if body.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported: the engine builds one grammar per "
                          "constraint", "guided_whitespace_pattern")
    found: list[Constraint] = []
    if body.response_format is not None:
        from_format = _from_response_format(body.response_format)
        found += [from_format] if from_format else []
    if body.guided_json is not None:
        found.append(_outputs("guided_json", json=schema_text(body.guided_json, "guided_json")))
    for name in ("regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            found.append(_outputs(f"guided_{name}", **{name: value}))
    if body.structured_outputs is not None:
        found += _from_structured_outputs(body.structured_outputs)
    if forced_call is not None:
        found.append(forced_call)
    if len(found) > 1:
        names = [c.param for c in found]
        raise bad_request(f"a request may constrain its output one way; this one sets {', '.join(names)}", names[-1])
    return found[0] if found else None


# How the engine says a constraint does not compile: "structured_outputs.<kind> does not compile: <why>"
_NOT_COMPILED = re.compile(r"structured_outputs\.\w+ does not compile: (.*)", re.S)


def compile_error(error: str | None, param: str | None) -> APIError | None:
    """The 400 for a worker's error that says the request's constraint does not compile, naming the request's
    field (the engine knows only its kind); None for any other error."""
    found = _NOT_COMPILED.fullmatch(error or "")
    if found is None or param is None:
        return None
    return bad_request(f"{param} does not compile: {found.group(1)}", param)
