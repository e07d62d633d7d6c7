"""engine.server.anthropic without a server: request translation (checked against the chat route's own
request model and message parsing), reply translation, the stream converter, and the error shapes."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from engine.chat_utils import parse_chat_messages
from engine.server.anthropic.errors import (
    anthropic_error_body,
    error_type,
    from_openai_error,
    to_anthropic_error,
)
from engine.server.anthropic.protocol import Message, MessagesRequest
from engine.server.anthropic.stream import anthropic_events, chunks_from_sse
from engine.server.anthropic.translate import message_id, to_anthropic_message, to_chat_request
from engine.server.errors import BadRequestError
from engine.server.protocol import ChatCompletionRequest

FULL_REQUEST = {
    "model": "tiny-llama:adapter-a", "max_tokens": 256, "stream": True,
    "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools.",
                                                            "cache_control": {"type": "ephemeral"}}],
    "stop_sequences": ["###"], "temperature": 0.5, "top_p": 0.9, "top_k": 40,
    "metadata": {"user_id": "u-1"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
    "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    "tools": [{"name": "lookup", "description": "Look up", "input_schema": {"type": "object"}},
              {"name": "noop", "input_schema": {"type": "object"}, "type": "custom"}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at this"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look it up.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xxx"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "café"}},
            {"type": "tool_use", "id": "toolu_2", "name": "noop", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "found"},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
            {"type": "text", "text": "Thanks"}]},
        {"role": "assistant", "content": "Partial answer"},
    ],
}
EXPECTED_CHAT = {
    "model": "tiny-llama:adapter-a", "max_tokens": 256, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
    "stop": ["###"], "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "user": "u-1", "chat_template_kwargs": {"enable_thinking": True},
    "response_format": {"type": "json_schema",
                        "json_schema": {"name": "output", "schema": {"type": "object"}}},
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"},
                                                "description": "Look up"}},
              {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}],
    "tool_choice": "required", "parallel_tool_calls": False,
    "messages": [
        {"role": "system", "content": "You are terse.\nUse tools."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look at this"},
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}]},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "I should look it up.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "lookup",
                                                                          "arguments": '{"q": "café"}'}},
                        {"id": "toolu_2", "type": "function",
                         "function": {"name": "noop", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "found"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                     {"type": "text", "text": "Thanks"}]},
        {"role": "assistant", "content": "Partial answer"},
    ],
}


def test_request_translation():
    chat = to_chat_request(MessagesRequest.model_validate(FULL_REQUEST))
    assert chat == EXPECTED_CHAT


def test_translation_is_a_chat_request_the_server_takes():
    chat = to_chat_request(MessagesRequest.model_validate(FULL_REQUEST))
    req = ChatCompletionRequest.model_validate(chat)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    assert messages[2]["tool_calls"][0]["id"] == "toolu_1" and messages[3]["tool_call_id"] == "toolu_1"
    parsed = parse_chat_messages(messages, takes_images=True)
    assert parsed.images == ["data:image/jpeg;base64,/9j/4AAQ", "https://example.com/a.png"]
    minimal = to_chat_request(MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}))
    assert minimal == {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(minimal).stream is False


def test_thinking_disabled_and_tool_choice_forms():
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    chat = to_chat_request(MessagesRequest.model_validate(
        base | {"thinking": {"type": "disabled"}, "tool_choice": {"type": "tool", "name": "f"}}))
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert "parallel_tool_calls" not in chat
    assert "tool_choice" not in to_chat_request(MessagesRequest.model_validate(base))


@pytest.mark.parametrize("body, message", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool"}}, "needs the tool's 'name'"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "temperature": -1},
     "temperature"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "x"}}]}]},
     "media_type"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
      "stop_sequences": ["s"] * 10_000}, "stop_sequences has 10000 strings"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "top_p": float("nan")},
     "finite"),
])
def test_request_validation(body, message):
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate(body)
    response = to_anthropic_error(e.value)
    assert response.status_code == 400
    payload = json.loads(response.body)
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert message in payload["error"]["message"]


def test_user_tool_use_is_refused():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]})
    with pytest.raises(ValueError,
                       match=r"messages\[0\].content\[0\]: a tool_use block belongs in an assistant"):
        to_chat_request(req)


def _completion(message, finish="stop", stop_reason=None):
    return {"id": "chatcmpl-42ab", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


@pytest.mark.parametrize("message, finish, stop, stop_sequences, expected", [
    ({"content": "hi"}, "stop", None, None, ("end_turn", None)),
    ({"content": "hi"}, "stop", "###", ["###"], ("stop_sequence", "###")),
    ({"content": "hi"}, "stop", 128001, ["###"], ("end_turn", None)),          # a stop token id
    ({"content": "hi"}, "stop", "</s>", ["###"], ("end_turn", None)),          # not one of the request's
    ({"content": "hi"}, "length", None, None, ("max_tokens", None)),
    ({"content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                       "function": {"name": "f", "arguments": "{}"}}]},
     "tool_calls", None, None, ("tool_use", None)),
])
def test_stop_reasons(message, finish, stop, stop_sequences, expected):
    msg = to_anthropic_message(_completion(message, finish, stop), stop_sequences)
    assert (msg.stop_reason, msg.stop_sequence) == expected


def test_reply_translation():
    msg = to_anthropic_message(_completion({
        "content": "Here.", "reasoning_content": "Think.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"cut'}}]},
        finish="length"))
    assert msg.model_dump(mode="json") == {
        "id": "msg_42ab", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "thinking", "thinking": "Think.", "signature": ""},
                    {"type": "text", "text": "Here."},
                    {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": [1]}},
                    {"type": "tool_use", "id": "call_2", "name": "g", "input": {}}],
        "stop_reason": "max_tokens", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 4}}
    assert message_id(None).startswith("msg_") and len(message_id(None)) > 10


def _run_stream(chunks, **kwargs):
    async def source():
        for c in chunks:
            yield c

    async def collect():
        return [e async for e in anthropic_events(source(), model="m", **kwargs)]

    events = asyncio.run(collect())
    return [(e.split("\n")[0][7:], json.loads(e.split("\n")[1][6:])) for e in events]


def test_stream_of_text_then_tool_calls():
    def chunk(delta, finish=None):
        return {"id": "chatcmpl-9", "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2}}

    events = _run_stream([
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}},
                              {"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({}, "tool_calls")])
    assert [(n, d.get("index")) for n, d in events] == [
        ("message_start", None), ("content_block_start", 0), ("ping", None), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    assert events[0][1]["message"]["id"] == "msg_9" and events[0][1]["message"]["usage"]["input_tokens"] == 5
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}
    assert events[-2][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 5, "output_tokens": 2}}


def test_empty_stream_and_error_chunk():
    events = _run_stream([], input_tokens=4)
    assert [n for n, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]
    assert events[2][1]["delta"]["stop_reason"] == "end_turn"
    events = _run_stream([{"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "a"}}]},
                          {"error": {"message": "Engine died", "type": "ServiceUnavailableError",
                                     "code": 503}}])
    assert [n for n, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                      "content_block_stop", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "Engine died"}}


def test_chunks_from_sse_split_anywhere():
    text = ('data: {"a": 1}\n\n: comment\n\ndata: {"b": "x\\n\\ny"}\n\n'
            'data: [DONE]\n\ndata: {"after": 1}\n\n')

    async def collect(pieces):
        async def source():
            for p in pieces:
                yield p
        return [c async for c in chunks_from_sse(source())]

    for cut in range(len(text) + 1):
        assert asyncio.run(collect([text[:cut], text[cut:].encode()])) == [{"a": 1}, {"b": "x\n\ny"}], cut


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"), (504, "timeout_error"),
    (529, "overloaded_error"), (502, "api_error")])
def test_error_types(status, kind):
    assert error_type(status) == kind
    assert anthropic_error_body(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_errors_from_exceptions_and_openai_bodies():
    response = to_anthropic_error(BadRequestError("must be positive", param="max_tokens"))
    assert response.status_code == 400
    assert json.loads(response.body)["error"] == {"type": "invalid_request_error",
                                                  "message": "max_tokens: must be positive"}
    response = from_openai_error({"error": {"message": "busy", "type": "x", "param": None, "code": 503}}, 503,
                                 {"Retry-After": "5"})
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert json.loads(response.body)["error"]["type"] == "overloaded_error"
    assert Message.model_validate(json.loads(json.dumps({
        "id": "msg_1", "model": "m", "usage": {"input_tokens": 1, "output_tokens": 1}}))).type == "message"
