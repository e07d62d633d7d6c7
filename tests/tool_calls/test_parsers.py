"""The --tool-call-parser formats: what a whole reply parses to, and streamed deltas that reassemble to
exactly that for every way of splitting the reply (each split point, each character alone, and random
splits of generated replies)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tool_calls.constrained import ConstrainedToolParser
from engine.tool_calls.ids import counting_ids, mistral_tool_call_id, openai_tool_call_id
from engine.tool_calls.parser import ExtractedToolCalls, StreamPiece, ToolCall, assemble, to_openai_deltas
from engine.tool_calls.registry import TOOL_PARSERS, get_tool_parser

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                    suppress_health_check=[HealthCheck.too_slow])
"""Deterministic hypothesis runs (the same examples every time)."""


def parser(name: str):
    if name == "required":
        return ConstrainedToolParser(None, counting_ids())
    if name == "named":
        return ConstrainedToolParser("get_weather", counting_ids())
    return get_tool_parser(name, counting_ids())


def stream(name: str, deltas: list[str]) -> list[StreamPiece]:
    s = parser(name).streaming()
    pieces: list[StreamPiece] = []
    for d in deltas:
        pieces += s.feed(d)
    return pieces + s.finish()


def calls(*items: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(items)]


WEATHER = '{"city": "Paris", "unit": "celsius"}'
CASES = {
    "hermes": [
        ("plain text", ExtractedToolCalls("plain text")),
        ('<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>',
         ExtractedToolCalls(None, calls(("get_weather", WEATHER)))),
        (('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'),
         ExtractedToolCalls("Let me look.\n\n", calls(("get_weather", '{"city": "Paris"}'),
                                                      ("get_time", '{"tz": "CET"}')))),
        # arguments before the name; strings holding braces, quotes and the close tag's start
        ('<tool_call>{"arguments": {"q": "a}\\"<b"}, "name": "search"}</tool_call>',
         ExtractedToolCalls(None, calls(("search", '{"q": "a}\\"<b"}')))),
        ('<tool_call>{"name": "now"}</tool_call>', ExtractedToolCalls(None, calls(("now", "{}")))),
        # not calls: no object, an unknown key first, a name that is not a string
        ("<tool_call>hello</tool_call>", ExtractedToolCalls("<tool_call>hello</tool_call>")),
        ('<tool_call>{"answer": 42}</tool_call>',
         ExtractedToolCalls('<tool_call>{"answer": 42}</tool_call>')),
        ('<tool_call>{"name": 7}</tool_call>', ExtractedToolCalls('<tool_call>{"name": 7}</tool_call>')),
        # cut short after the name: still a call, arguments as written
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
         ExtractedToolCalls(None, calls(("get_weather", '{"city": "Pa')))),
        ('<tool_call>{"nam', ExtractedToolCalls('<tool_call>{"nam')),
        ("a <tool_ca", ExtractedToolCalls("a <tool_ca")),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + '}',
         ExtractedToolCalls(None, calls(("get_weather", WEATHER)))),
        ('{"name": "a", "parameters": {"x": [1, {"y": "};"}]}}; {"name": "b", "parameters": {}}',
         ExtractedToolCalls(None, calls(("a", '{"x": [1, {"y": "};"}]}'), ("b", "{}")))),
        ('{"type": "function", "name": "a", "parameters": {}} and then some',
         ExtractedToolCalls(" and then some", calls(("a", "{}")))),
        ('{"answer": "Paris"}', ExtractedToolCalls('{"answer": "Paris"}')),
        ('Sure: {"name": "a", "parameters": {}}',
         ExtractedToolCalls('Sure: {"name": "a", "parameters": {}}')),
        ("<|python_tag|>brave_search.call(query=\"x\")",
         ExtractedToolCalls("<|python_tag|>brave_search.call(query=\"x\")")),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER
         + '}, {"name": "b", "arguments": {}}]',
         ExtractedToolCalls(None, calls(("get_weather", WEATHER), ("b", "{}")))),
        ('[TOOL_CALLS]get_weather[ARGS]' + WEATHER + '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
         ExtractedToolCalls(None, calls(("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')))),
        ('Checking. [TOOL_CALLS]{"name": "a", "arguments": {"k": 1}}',
         ExtractedToolCalls("Checking. ", calls(("a", '{"k": 1}')))),
        ("[TOOL_CALLS] nothing here", ExtractedToolCalls("[TOOL_CALLS] nothing here")),
        ('[TOOL_CALLS]get_weather[ARGS]"Paris"', ExtractedToolCalls('[TOOL_CALLS]get_weather[ARGS]"Paris"')),
        ('[TOOL_CALLS][{"name": "a", "arguments": {}}, oops]',
         ExtractedToolCalls(", oops]", calls(("a", "{}")))),
    ],
    "required": [
        ('[{"name": "get_weather", "parameters": ' + WEATHER + '}, {"name": "get_time", "parameters": {}}]',
         ExtractedToolCalls(None, calls(("get_weather", WEATHER), ("get_time", "{}")))),
    ],
    "named": [
        (WEATHER, ExtractedToolCalls(None, calls(("get_weather", WEATHER)))),
    ],
}
ALL_CASES = [(name, text, expected) for name, cases in CASES.items() for text, expected in cases]


@pytest.mark.parametrize("name, text, expected", ALL_CASES)
def test_extract(name, text, expected):
    assert parser(name).extract(text) == expected


@pytest.mark.parametrize("name, text, expected", ALL_CASES)
def test_every_split_reassembles_to_extract(name, text, expected):
    """Two deltas split at each position, and one delta per character."""
    for cut in range(len(text) + 1):
        assert assemble(stream(name, [text[:cut], text[cut:]])) == expected, cut
    assert assemble(stream(name, list(text))) == expected


def _check_delta_shapes(pieces: list[StreamPiece]) -> None:
    """Each call's first delta has its id, type and name (arguments ""), later ones arguments only; calls
    are numbered 0, 1, ... in order."""
    seen: list[int] = []
    for p in pieces:
        assert (p.content is None) != (p.tool_call is None)
        d = p.tool_call
        if d is None:
            continue
        if d.index not in seen:
            assert d.index == len(seen)
            assert d.id and d.type == "function" and d.function.name and d.function.arguments is not None
            seen.append(d.index)
        else:
            assert d.id is None and d.type is None and d.function.name is None and d.function.arguments


FRAGMENTS = {
    "hermes": ['<tool_call>{"name": "f", "arguments": {"a": "}"}}</tool_call>', "<tool_call>", "</tool_call>",
               "<tool_", "call>", "<", "/", '{"name": "f"', '"arguments"', ":",
               '{"a": 1}', "{", "}", ",", '"', "\\", "\n", " ", "text", '"name"', '"x"', "[", "]"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}}', "<|python_tag|>", "<|python", '{"name": "f"',
                    '"parameters"', ":", '{"a": [1]}', "{", "}",
                    ";", ",", '"', "\n", " ", "text", '"type": "function"', '"q"'],
    "mistral": ['[TOOL_CALLS]f[ARGS]{"a": "]"}', "[TOOL_CALLS]", "[ARGS]", "[TOOL_", "f", "get_x", "[", "]",
                '{"name": "f"', '"arguments"', ":",
                '{"a": 1}', "{", "}", ",", '"', "\n", " ", "text"],
    "required": ['[{"name": "f", "parameters": {}}]', "[", "]", '{"name": "f"', '"parameters"', ":",
                 '{"a": 1}', "{", "}", ",", '"', " ", "x"],
}


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@SETTINGS
@given(data=st.data())
def test_random_replies_reassemble_under_random_splits(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=30), label="fragments"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts"))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    pieces = stream(name, deltas)
    _check_delta_shapes(pieces)
    assert assemble(pieces) == parser(name).extract(text)


@pytest.mark.parametrize("name, text, expected", [c for c in ALL_CASES if c[2].tool_calls])
def test_openai_sdk_accepts_the_deltas(name, text, expected):
    """The deltas, as chunks, validate as the openai SDK's ChatCompletionChunk, and the SDK's types
    accumulate to the non-streamed calls."""
    from openai.types.chat import ChatCompletionChunk
    calls_by_index: dict[int, dict] = {}
    for delta in to_openai_deltas(stream(name, list(text))):
        chunk = ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls_by_index.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] = (tc.function.name if tc.function else None) or entry["name"]
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    got = [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls_by_index.items())]
    assert got == expected.tool_calls


def test_message_tool_calls_shape():
    from openai.types.chat import ChatCompletionMessage
    extracted = parser("hermes").extract('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    message = ChatCompletionMessage.model_validate({
        "role": "assistant", "content": extracted.content,
        "tool_calls": [c.to_openai() for c in extracted.tool_calls]})
    assert message.tool_calls[0].function.name == "f"
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 1}


def test_ids():
    import re
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", openai_tool_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral_tool_call_id())
    assert openai_tool_call_id() != openai_tool_call_id()
    mistral = get_tool_parser("mistral").extract("[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}")
    ids = [c.id for c in mistral.tool_calls]
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    hermes = get_tool_parser("hermes").extract('<tool_call>{"name": "a"}</tool_call>')
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", hermes.tool_calls[0].id)


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert [TOOL_PARSERS[n].needs_special_tokens for n in ("hermes", "llama3_json", "mistral")] == [
        False, True, True]
    with pytest.raises(ValueError, match=r"Unknown tool-call parser 'nope'.*hermes, llama3_json, mistral"):
        get_tool_parser("nope")


def test_streaming_is_incremental():
    """The call is reported once its name is read and its arguments stream as they arrive; content that
    cannot be a tag goes out at once."""
    s = parser("hermes").streaming()
    assert s.feed("Hi") == [StreamPiece(content="Hi")]
    assert s.feed(" <tool") == [StreamPiece(content=" ")]
    assert s.feed('_call>{"name": "f') == []
    assert [p.tool_call.to_openai() for p in s.feed('", ')] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}]
    assert [p.tool_call.to_openai() for p in s.feed('"arguments": {"a"')] == [
        {"index": 0, "function": {"arguments": '{"a"'}}]
    assert [p.tool_call.to_openai() for p in s.feed(": 1}")] == [
        {"index": 0, "function": {"arguments": ": 1}"}}]
    assert s.feed("}</tool_call>") == [] and s.finish() == [] and s.tools_called


def test_long_arguments_stream_in_linear_time():
    """A 200 kB argument string fed 3 characters at a time: each character is read once."""
    import time
    value = "x" * 200_000
    text = '<tool_call>{"name": "write", "arguments": {"text": "' + value + '"}}</tool_call>'
    start = time.perf_counter()
    pieces = stream("hermes", [text[i:i + 3] for i in range(0, len(text), 3)])
    assert assemble(pieces).tool_calls[0].arguments_json == '{"text": "' + value + '"}'
    assert time.perf_counter() - start < 20
