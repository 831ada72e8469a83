"""Tool calls out of a model's text, for ``tool_choice: "auto"``, with vLLM's parser names
(``--tool-call-parser``): each model family writes its calls its own way.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them
  (Hermes, Qwen2.5/Qwen3).
- ``llama3_json``: the whole reply is a JSON object ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``; several are separated by ``;`` (Llama 3.1+).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

One incremental parser serves both the streamed and the whole reply (``parse`` feeds it everything at
once), so a streamed reply's content and calls are exactly the unstreamed ones. Text is held back only
while it may still be markup (a partial marker, an unterminated call); a call whose JSON does not parse
stays in the content as the model wrote it, so nothing the model said is lost. Whitespace that only
separates content from calls is dropped.
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Parsed:
    """What one feed decided: content text, and calls complete with their arguments."""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded JSON value, or None if it is not shaped like one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write arguments already encoded
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker`` (may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Feed text as it arrives, then ``finish()``; each returns what became certain."""

    def __init__(self) -> None:
        self._buf = ""  # undecided text
        self._held_space = ""  # whitespace after content: kept only if more content follows
        self.calls: list[ToolCall] = []
        self._content_parts: list[str] = []

    @property
    def content(self) -> str | None:
        """All the content decided so far; None when the reply is only calls."""
        text = "".join(self._content_parts)
        return None if not text and self.calls else text

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        self._advance(out, final=False)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        self._advance(out, final=True)
        if self._buf:  # what never became a call (an unterminated one that did not parse) is content
            self._emit_text(out, self._buf)
            self._buf = ""
        if not self.calls:  # trailing whitespace of a reply without calls is the model's text
            self._add_content(out, self._held_space)
        self._held_space = ""
        return out

    def _advance(self, out: Parsed, final: bool) -> None:
        raise NotImplementedError

    def _add_content(self, out: Parsed, text: str) -> None:
        if text:
            out.content += text
            self._content_parts.append(text)

    def _emit_text(self, out: Parsed, text: str) -> None:
        """Content, its trailing whitespace held until more content shows it is not a separator."""
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            self._add_content(out, self._held_space + stripped)
            self._held_space = text[len(stripped):]
        else:
            self._held_space += text

    def _emit_call(self, out: Parsed, call: ToolCall) -> None:
        self._held_space = ""  # whitespace before a call only separated it from the content
        self.calls.append(call)
        out.calls.append(call)

    def _skip_separator(self) -> None:
        """Whitespace right after a call separates it from what follows: not content on its own."""
        stripped = self._buf.lstrip()
        self._held_space = ""
        if stripped != self._buf:
            self._held_space = self._buf[:len(self._buf) - len(stripped)]
            self._buf = stripped


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def _advance(self, out: Parsed, final: bool) -> None:
        while self._buf:
            start = self._buf.find(self.START)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, self.START)
                self._emit_text(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            self._emit_text(out, self._buf[:start])
            self._buf = self._buf[start:]
            end = self._buf.find(self.END)
            if end < 0 and not final:
                return  # an open call: wait for its end
            body = self._buf[len(self.START):end if end >= 0 else len(self._buf)]
            raw_len = end + len(self.END) if end >= 0 else len(self._buf)
            call = self._decode(body)
            if call is None:  # malformed: the model's text stays as it wrote it
                self._emit_text(out, self._buf[:raw_len])
            else:
                self._emit_call(out, call)
            self._buf = self._buf[raw_len:]
            if call is not None:
                self._skip_separator()

    @staticmethod
    def _decode(body: str) -> ToolCall | None:
        try:
            return _call_of(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            return None


class Llama3JsonParser(ToolCallParser):
    """Calls only when the reply starts with one (after whitespace): a reply that opens with prose is
    prose, however much JSON it quotes later."""
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided, "text", "calls"

    def _advance(self, out: Parsed, final: bool) -> None:
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
                self._mode = "calls" if head or final else None
                if self._mode is None:
                    return
            elif not head or (not final and self.TAG.startswith(head)):
                if final:
                    self._mode = "text"
                else:
                    return
            if self._mode is None:
                self._mode = "calls" if head.startswith("{") else "text"
            if self._mode == "calls":
                self._buf = head
        if self._mode == "text":
            self._add_content(out, self._buf)
            self._buf = ""
            return
        while self._buf:
            if self.calls:  # between calls: whitespace and one ';'
                rest = self._buf.lstrip()
                self._buf = rest[1:].lstrip() if rest.startswith(";") else rest
                if not self._buf or not self._buf.startswith("{"):
                    return  # more to come, or not another call: then finish() makes the rest content
            try:
                obj, end = _DECODER.raw_decode(self._buf)
            except ValueError:
                return  # incomplete, or never a call: finish() makes what is left content
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return
            self._emit_call(out, call)
            self._buf = self._buf[end:]


class MistralParser(ToolCallParser):
    MARKER = "[TOOL_CALLS]"

    def _advance(self, out: Parsed, final: bool) -> None:
        while self._buf:
            start = self._buf.find(self.MARKER)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, self.MARKER)
                self._emit_text(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            self._emit_text(out, self._buf[:start])
            self._buf = self._buf[start:]
            body = self._buf[len(self.MARKER):]
            try:
                value, end = _DECODER.raw_decode(body.lstrip())
            except ValueError:
                return  # still arriving, or never completes: then finish() makes it content
            end += len(body) - len(body.lstrip())
            items = value if isinstance(value, list) else [value]
            calls = [_call_of(item, ("arguments", "parameters")) for item in items]
            raw_len = len(self.MARKER) + end
            if not calls or any(c is None for c in calls):
                self._emit_text(out, self._buf[:raw_len])
            else:
                for call in calls:
                    self._emit_call(out, call)
            self._buf = self._buf[raw_len:]
            if calls and all(c is not None for c in calls):
                self._skip_separator()


_CLASSES: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                             "mistral": MistralParser}


def make_parser(name: str) -> ToolCallParser:
    return _CLASSES[name]()


def parse(name: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply: its content (None when it is only calls) and its calls."""
    parser = make_parser(name)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
