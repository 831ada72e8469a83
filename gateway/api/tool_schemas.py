"""The tool-calling parts of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and the
``tool_calls`` / ``tool_call_id`` of messages in the history, checked to OpenAI's shapes (a 400 naming the
field), and turned into what chat templates expect.

What a request asks for (``ToolPlan``): ``tool_choice: "none"`` offers no tools to the model and parses
nothing; ``"auto"`` (the default when tools are given, as in OpenAI and vLLM) offers them through the chat
template and parses the reply with ``--tool-call-parser``, which, as in vLLM, needs
``--enable-auto-tool-choice``. ``"required"`` and a named function force the model to call: its output
is constrained to a call (forced_calls.py), with no parser, so they need neither flag.
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict

from kvrelay.gateway.errors import bad_request

_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


class _Strict(BaseModel):
    # As the request body: no coercion; unknown keys are refused (a misspelt "paramaters" would be a tool
    # whose arguments the model never sees).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """What the chat template and the reply do with a request's tools."""
    tools: list[dict] | None  # for the template's ``tools=``; None: none offered
    parser: str | None  # the reply's parser; None: the reply is plain content
    parallel: bool  # False: only the first call is returned
    forced: Literal["required", "named"] | None = None  # the model must call; None: it may answer
    function: str | None = None  # the function a named choice calls

    @property
    def reads_calls(self) -> bool:
        """Whether the reply's text is read for calls (auto's parser, or a forced call)."""
        return self.parser is not None or self.forced is not None


NO_TOOLS = ToolPlan(tools=None, parser=None, parallel=True)


def check_tools(tools: list[ToolDefinition]) -> None:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools may hold at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _FUNCTION_NAME.fullmatch(fn.name):
            raise bad_request(f"tools.{i}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                              f"{fn.name!r}", f"tools.{i}.function.name")
        if fn.name in seen:
            raise bad_request(f"tools.{i}.function.name {fn.name!r} is defined twice", f"tools.{i}.function.name")
        seen.add(fn.name)
        if fn.parameters is not None:
            _check_parameters(fn.parameters, f"tools.{i}.function.parameters")


def _check_strict(tools: list[ToolDefinition]) -> None:
    """``strict``: the arguments are guaranteed to match the schema. Forced calls are constrained to it;
    auto's calls are the model's free text, parsed, which nothing guarantees."""
    for i, tool in enumerate(tools):
        if tool.function.strict:
            raise bad_request("strict function calling needs tool_choice \"required\" or a named function (their "
                              "calls are constrained to the schema; \"auto\" ones are not)", f"tools.{i}.function.strict")


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    """A JSON Schema describing an object: what OpenAI accepts, and what templates render as arguments."""
    if schema.get("type", "object") != "object":
        raise bad_request(f"{param} must be a JSON Schema of type \"object\", got type {schema['type']!r}", param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise bad_request(f"{param} is not a valid JSON Schema: {exc.message}"
                          + (f" (at {where})" if where else ""), param) from None


def plan_tools(tools: list[ToolDefinition] | None, tool_choice: Any, parallel: bool,
               parser: str | None, auto_enabled: bool) -> ToolPlan:
    """What to do with a request's tools, or a 400 naming the field."""
    offered = bool(tools)
    if tools:
        check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if offered else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got "
                              f"{tool_choice!r}", "tool_choice")
        named = None
    elif isinstance(tool_choice, dict):
        named = _named_function(tool_choice)
    else:
        raise bad_request("tool_choice must be a string or an object naming a function", "tool_choice")
    if tool_choice == "none":
        return NO_TOOLS
    if not offered:
        raise bad_request("tool_choice needs tools: set tools, or leave tool_choice out", "tool_choice")
    if named is not None:
        if named not in {t.function.name for t in tools or ()}:
            raise bad_request(f"tool_choice names function {named!r}, which is not in tools", "tool_choice")
    offer = [t.model_dump(exclude_none=True) for t in tools or ()]
    if named is not None or tool_choice == "required":
        return ToolPlan(tools=offer, parser=None, parallel=parallel, forced="named" if named else "required",
                        function=named)
    _check_strict(tools or [])
    if not (auto_enabled and parser):
        # vLLM's answer, word for word: clients moving from vLLM recognise it
        raise bad_request("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
                          "tool_choice")
    return ToolPlan(tools=offer, parser=parser, parallel=parallel)


def _named_function(choice: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or \
            not isinstance(function.get("name"), str) or set(choice) - {"type", "function"} or set(function) != {"name"}:
        raise bad_request("tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice")
    return function["name"]


def template_history(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """Messages with their tool parts checked and in the form chat templates read: a call's arguments as
    an object (templates write ``arguments | tojson``; a JSON string there would be encoded twice, as vLLM
    also avoids). Also the first tool part's field, for a 400 when the template cannot render tools."""
    out = []
    first: str | None = None
    for i, message in enumerate(messages):
        # null or empty means none (some clients send the keys on every message)
        entry = {k: v for k, v in message.items() if not (k in ("tool_calls", "tool_call_id") and v in (None, []))}
        if "tool_calls" in entry:
            if entry["role"] != "assistant":
                raise bad_request("only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
            entry["tool_calls"] = _calls_for_template(entry["tool_calls"], i)
            first = first or f"messages.{i}.tool_calls"
        if entry["role"] == "tool":
            if not isinstance(entry.get("tool_call_id"), str):
                raise bad_request("a tool message needs tool_call_id (the id of the call it answers)",
                                  f"messages.{i}.tool_call_id")
            first = first or f"messages.{i}.role"
        elif "tool_call_id" in entry:
            raise bad_request("only tool messages carry tool_call_id", f"messages.{i}.tool_call_id")
        if entry["role"] == "assistant" and entry.get("content") is None and "tool_calls" not in entry:
            raise bad_request("an assistant message needs content or tool_calls", f"messages.{i}.content")
        out.append(entry)
    return out, first


def _calls_for_template(raw: Any, index: int) -> list[dict[str, Any]]:
    param = f"messages.{index}.tool_calls"
    if not isinstance(raw, list):
        raise bad_request(f"{param} must be a list of tool calls", param)
    calls = []
    for j, item in enumerate(raw):
        try:
            call = MessageToolCall.model_validate(item, strict=True)
        except ValueError as exc:
            first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
            where = ".".join([param, str(j), *(str(p) for p in first["loc"])])
            raise bad_request(f"{where}: {first['msg']}", where) from None
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            where = f"{param}.{j}.function.arguments"
            raise bad_request(f"{where} must be a JSON object encoded as a string", where)
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls
