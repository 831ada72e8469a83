"""Tool-call parsers (gateway/api/tool_parsers.py) and the reply shapes built on them
(gateway/api/tool_replies.py): whole replies, and the same replies fed in every split, which must give the
same content and calls without ever showing call markup as content."""

import json
import random

import pytest

from kvrelay.gateway.api.tool_parsers import make_parser, parse
from kvrelay.gateway.api.tool_replies import StreamedToolCalls, reply_message
from kvrelay.gateway.api.tool_schemas import ToolPlan

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "exact": true}}'


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


PARIS = ("get_weather", {"city": "Paris"})
CET = ("get_time", {"zone": "CET", "exact": True})

# (parser, model output, expected content, expected calls)
CASES = [
    # hermes
    ("hermes", f"<tool_call>{WEATHER}</tool_call>", None, [PARIS]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None, [PARIS, CET]),
    ("hermes", f"Let me look.\n<tool_call>{WEATHER}</tool_call>", "Let me look.", [PARIS]),
    ("hermes", f"Before <tool_call>{WEATHER}</tool_call> after.", "Before after.", [PARIS]),
    ("hermes", "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>",
     "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>", []),
    ("hermes", f"<tool_call>{{not json}}</tool_call> then <tool_call>{WEATHER}</tool_call>",
     "<tool_call>{not json}</tool_call> then", [PARIS]),
    ("hermes", f"<tool_call>{WEATHER}", None, [PARIS]),  # cut before its end tag, yet complete
    ("hermes", "Plain text, a < sign and <tool_ but no call.", "Plain text, a < sign and <tool_ but no call.", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "  spaced  ", "  spaced  ", []),
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; ' + TIME, None, [PARIS, CET]),
    ("llama3_json", 'The answer is {"name": "get_weather"}', 'The answer is {"name": "get_weather"}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ',
     []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", "Hello", "Hello", []),
    # mistral
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", None, [PARIS, CET]),
    ("mistral", f"Sure. [TOOL_CALLS] [{WEATHER}]", "Sure.", [PARIS]),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {", "[TOOL_CALLS][{\"name\": \"get_weather\", "
     "\"arguments\": {", []),
    ("mistral", "[TOOL_CALLS] [{\"nam\": 1}]", "[TOOL_CALLS] [{\"nam\": 1}]", []),
    ("mistral", "No calls [TOOL here.", "No calls [TOOL here.", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_reply(name, text, content, calls):
    got_content, got_calls = parse(name, text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_in_any_split_matches_the_whole_reply(name, text, content, calls):
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        parser = make_parser(name)
        streamed, got = [], []
        for piece in pieces:
            out = parser.feed(piece)
            streamed.append(out.content)
            got += out.calls
        out = parser.finish()
        streamed.append(out.content)
        got += out.calls
        assert calls_of(got) == calls, pieces
        assert ("".join(streamed) or None if calls else "".join(streamed)) == content, pieces
        if calls:  # markup of a call that parsed never reaches the client as content
            assert "<tool_call>" not in "".join(streamed) or "<tool_call>{not json}" in text


def test_character_by_character_holds_back_only_what_may_be_markup():
    parser = make_parser("hermes")
    shown = [parser.feed(ch).content for ch in "Hi <tool"]
    assert "".join(shown) == "Hi"  # " <tool" may become a call: held
    assert parser.feed("s are great").content == " <tools are great"


PLAN = ToolPlan(tools=[{}], parser="hermes", parallel=True)
TWO = f"Checking.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>"


def test_reply_message_carries_calls_and_finish_reason():
    message, finish = reply_message(TWO, "stop", PLAN)
    assert finish == "tool_calls" and message["content"] == "Checking."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("function", *PARIS), ("function", *CET)]
    # cut by max_tokens: the client must see it is incomplete
    assert reply_message(TWO, "length", PLAN)[1] == "length"
    only_first, _ = reply_message(TWO, "stop", ToolPlan(tools=[{}], parser="hermes", parallel=False))
    assert [c["function"]["name"] for c in only_first["tool_calls"]] == ["get_weather"]
    plain, finish = reply_message("no calls", "stop", PLAN)
    assert plain == {"role": "assistant", "content": "no calls"} and finish == "stop"
    none_offered, _ = reply_message(TWO, "stop", ToolPlan(tools=None, parser=None, parallel=True))
    assert none_offered["content"] == TWO and "tool_calls" not in none_offered


def test_streamed_deltas_name_then_arguments():
    stream = StreamedToolCalls(PLAN)
    deltas = []
    for i in range(0, len(TWO), 5):
        piece = TWO[i:i + 5]
        got, finish = stream.feed(piece, "stop" if i + 5 >= len(TWO) else None)
        deltas += got
    assert finish == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "id" not in calls[1] and json.loads(calls[1]["function"]["arguments"]) == PARIS[1]
    assert calls[2]["function"]["name"] == "get_time"
    single = StreamedToolCalls(ToolPlan(tools=[{}], parser="hermes", parallel=False))
    got, _ = single.feed(TWO, "stop")
    assert [d["tool_calls"][0]["index"] for d in got if "tool_calls" in d] == [0, 0]
