"""A chat reply with tools offered: the model's text split into content and ``tool_calls``, whole or as
streamed deltas, in OpenAI's shapes. A call streams as two deltas: its index, id, type and name, then its
arguments (a call is only sent once its JSON is complete, so the arguments come in one piece).
``parallel_tool_calls: false`` keeps the first call only, as vLLM does. A forced call (``tool_choice``
"required" or a named function) is read by forced_calls.py; its finish_reason is OpenAI's: "tool_calls" for
required, "stop" for a named function (vLLM answers "stop" for both unstreamed and "tool_calls" for both
streamed; OpenAI's pair is the same either way)."""

from typing import Any

from kvrelay.gateway.api.forced_calls import ForcedCallReader, call_deltas
from kvrelay.gateway.api.tool_parsers import ToolCall, make_parser, parse
from kvrelay.gateway.api.tool_schemas import ToolPlan


def _finish_reason(finish_reason: str | None, called: bool, plan: ToolPlan) -> str | None:
    # A reply cut by max_tokens keeps "length": the client must know it is incomplete.
    return "tool_calls" if called and finish_reason == "stop" and plan.forced != "named" else finish_reason


def _forced_message(text: str, finish_reason: str | None, plan: ToolPlan) -> tuple[dict[str, Any], str | None]:
    reader = ForcedCallReader(plan)
    reader.feed(text)
    _, content = reader.finish()
    calls = reader.calls
    if plan.forced == "named":  # the whole output is the arguments
        calls = [ToolCall(name=calls[0].name, arguments=text, id=calls[0].id)]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, _finish_reason(finish_reason, bool(calls), plan)


def reply_message(text: str, finish_reason: str | None, plan: ToolPlan) -> tuple[dict[str, Any], str | None]:
    """The choice's message and finish_reason."""
    if plan.forced is not None:
        return _forced_message(text, finish_reason, plan)
    if plan.parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse(plan.parser, text)
    if not plan.parallel:
        calls = calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, _finish_reason(finish_reason, bool(calls), plan)


class StreamedToolCalls:
    """One choice's stream: text in, chunk deltas out."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.reads_calls
        self._plan = plan
        self._forced = ForcedCallReader(plan) if plan.forced is not None else None
        self._parser = make_parser(plan.parser) if plan.parser is not None else None
        self._parallel = plan.parallel
        self._sent = 0  # calls streamed so far

    def feed(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas for ``text`` (the last piece when ``finish_reason`` is set), and the finish_reason to send."""
        if self._forced is not None:
            deltas = self._forced.feed(text) if text else []
            if finish_reason is not None:
                more, content = self._forced.finish()
                deltas += more + ([{"content": content}] if content else [])
            return deltas, _finish_reason(finish_reason, bool(self._forced.calls), self._plan)
        assert self._parser is not None
        parsed = self._parser.feed(text) if text else None
        content = parsed.content if parsed else ""
        calls = list(parsed.calls) if parsed else []
        if finish_reason is not None:
            rest = self._parser.finish()
            content += rest.content
            calls += rest.calls
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            if self._sent and not self._parallel:
                break
            deltas += call_deltas(self._sent, call)
            self._sent += 1
        return deltas, _finish_reason(finish_reason, self._sent > 0, self._plan)
