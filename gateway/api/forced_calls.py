"""``tool_choice: "required"`` and a named function: the model must call, so its output is constrained to
a call, and the reply is that call (vLLM's way, with OpenAI's reply shapes).

- required: the output is a JSON array of at least one ``{"name": <a tool's name>, "parameters": <that
  tool's arguments>}`` (at most one with ``parallel_tool_calls: false``); each element becomes a call.
- named: the output is the function's arguments object itself; it becomes the one call's arguments.

Both are parsed by one incremental reader, fed the whole text or the stream's pieces, so a streamed reply
carries exactly the unstreamed one's calls. A required call streams once its element is complete (as the
auto parser's do); a named call's arguments stream as they are generated, as vLLM streams them. Output
cut short by max_tokens keeps what did not become a call as content, and the finish_reason "length".
"""

import json
from typing import Any

from kvrelay.gateway.api.output_constraints import Constraint, schema_text
from kvrelay.gateway.api.tool_parsers import ToolCall
from kvrelay.gateway.api.tool_schemas import ToolDefinition, ToolPlan
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

_NO_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters takes none


def call_constraint(plan: ToolPlan, tools: list[ToolDefinition]) -> Constraint | None:
    """The output schema ``plan``'s forced choice imposes; None when the model may answer freely."""
    if plan.forced is None:
        return None
    if plan.forced == "named":
        (tool,) = [t for t in tools if t.function.name == plan.function]
        schema: dict[str, Any] = _arguments(tool)
    else:
        # One branch per tool, each closed, so a call's name picks its own arguments schema.
        branches, defs = [], {}
        for i, t in enumerate(tools):
            arguments, own_defs = _rebased(_arguments(t), i)
            defs.update(own_defs)
            branches.append({
                "type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": arguments},
            })
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if defs:
            schema["$defs"] = defs
        if not plan.parallel:
            schema["maxItems"] = 1
    return Constraint(StructuredOutputs(json=schema_text(schema, "tool_choice")), "tool_choice")


def _arguments(tool: ToolDefinition) -> dict[str, Any]:
    """The tool's arguments schema; an object even where it leaves "type" out (tool_schemas.py reads a
    missing type as "object", and the grammar must too, or any JSON value would do)."""
    return {"type": "object", **(tool.function.parameters or _NO_PARAMETERS)}


_DEFS = ("$defs", "definitions")


def _rebased(schema: dict[str, Any], index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tool ``index``'s arguments schema as a branch of the required-call array, where "#" is no longer its
    root: its definitions move to the array's ``$defs`` (named ``<index>_<name>``, as two tools may both
    define one name), and its "#..." references are rewritten to where their targets now are."""
    base = f"#/items/anyOf/{index}/properties/parameters"

    def target(ref: str) -> str:
        for key in _DEFS:
            if ref.startswith(f"#/{key}/"):
                return f"#/$defs/{index}_{ref[len(key) + 3:]}"
        return base + ref[1:]

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: target(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    defs = {f"{index}_{name}": rewrite(sub) for key in _DEFS for name, sub in (schema.get(key) or {}).items()}
    return rewrite({k: v for k, v in schema.items() if k not in _DEFS}), defs


class ForcedCallReader:
    """One choice's forced output: text in (``feed``, then ``finish``), deltas out."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.forced is not None
        self._named = plan.function if plan.forced == "named" else None
        self._text = ""
        self._scanned = 0  # characters of _text read by the scanner
        self._depth = 0
        self._in_string = self._escaped = False
        self._element_start: int | None = None  # required: where the element being read began
        self._done_upto = 0  # required: text up to here became calls (or array punctuation)
        self.calls: list[ToolCall] = []
        self._call: ToolCall | None = None  # named: the one call, once its first piece is sent
        self._failed = False  # required: an element that is no call was read; the rest is content

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        if self._named is not None:
            return self._named_deltas(text)
        out = []
        for call in self._scan():
            out += call_deltas(len(self.calls), call)
            self.calls.append(call)
        return out

    def finish(self) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas for what is left, and the content (output that did not become a call, or None)."""
        if self._named is not None:  # the output is the arguments, whole or cut short (finish_reason says)
            return (self._named_deltas("") if self._call is None else []), None
        rest = self._text[self._done_upto:].strip().lstrip(",").strip()
        return [], None if rest in ("", "]") and self.calls else (rest or None)

    def _named_deltas(self, piece: str) -> list[dict[str, Any]]:
        if self._call is None:
            self._call = ToolCall(name=self._named, arguments="")
            self.calls.append(self._call)
            return [{"tool_calls": [{"index": 0, "id": self._call.id, "type": "function",
                                     "function": {"name": self._named, "arguments": piece}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []

    def _scan(self) -> list[ToolCall]:
        """Required: the array's elements completed by the text read since the last scan."""
        found: list[ToolCall] = []
        text = self._text
        if self._failed:
            return found
        for pos in range(self._scanned, len(text)):
            c = text[pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
                if self._depth == 2 and c == "{":
                    self._element_start = pos
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and c == "}" and self._element_start is not None:
                    call = _call_of(text[self._element_start:pos + 1])
                    if call is None:  # not a call's shape: it and what follows stay content
                        self._failed = True
                        break
                    found.append(call)
                    self._element_start = None
                    self._done_upto = pos + 1
        self._scanned = len(text)
        return found


def _call_of(element: str) -> ToolCall | None:
    try:
        obj = json.loads(element)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("parameters"), dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(obj["parameters"], ensure_ascii=False))


def call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A whole call as streamed deltas: its index, id, type and name, then its arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
