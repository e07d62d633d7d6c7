"""POST /v1/messages through the official anthropic SDK: a small FastAPI app serves the route with
engine.server.anthropic over a fake chat-completions backend that answers like Chorus' chat route
(canned model text, split by the real qwen3 reasoning parser and hermes tool parser; streamed as OpenAI
SSE chunks). Non-streamed and streamed text, a tool round trip, thinking, stop sequences, the event
sequence, and errors parsed by the SDK as the right exception class."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.reasoning.registry import get_reasoning_parser
from engine.server.anthropic.serving import AnthropicMessages
from engine.server.errors import NotFoundError
from engine.tool_calls.ids import counting_ids
from engine.tool_calls.parser import to_openai_deltas
from engine.tool_calls.registry import get_tool_parser
from engine.tool_calls.tool_choice import resolve_tool_choice

anthropic = pytest.importorskip("anthropic")

TOOL_TEXT = ('<think>The user wants weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
"""What the fake model writes when it has tools and no tool result yet."""
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                                  "unit": {"type": "string"}},
                                 "required": ["city"]}}
PROMPT_TOKENS = 11


def model_text(body: dict[str, Any]) -> tuple[str, Any]:
    """(reply text, matched stop string) of the fake model for a chat request body."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return f"It is 21 degrees in Paris ({last['content']}).", None
    if body.get("tools") and body.get("tool_choice") != "none":
        return TOOL_TEXT, None
    if "END" in (body.get("stop") or []):
        return "Counting: 1 2 3", "END"
    return "Hello! How can I help you today?", None


class FakeChatBackend:
    """Answers chat-completion request bodies as Chorus' chat route does (JSONResponse or SSE)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        """Every chat request body received."""

    async def __call__(self, body: dict[str, Any], raw_request: Request) -> Any:
        self.requests.append(body)
        if body["model"] == "no-such-model":
            raise NotFoundError("The model `no-such-model` does not exist.", param="model")
        if body["model"] == "busy":
            return JSONResponse({"error": {"message": "The engine is overloaded; retry later.", "type":
                                           "ServiceUnavailableError", "param": None, "code": 503}},
                                status_code=503, headers={"Retry-After": "5"})
        resolve_tool_choice(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"),
                            auto_enabled=True)
        text, matched = model_text(body)
        if body.get("stream"):
            return StreamingResponse(self._sse(body, text, matched), media_type="text/event-stream")
        reasoning, content = get_reasoning_parser("qwen3").extract(text)
        extracted = get_tool_parser("hermes", counting_ids("call_fake")).extract(content or "")
        message: dict[str, Any] = {"role": "assistant", "content": extracted.content,
                                   "tool_calls": [c.to_openai() for c in extracted.tool_calls]}
        if reasoning:
            message["reasoning_content"] = reasoning
        completion_tokens = len(text.split())
        return JSONResponse({
            "id": "chatcmpl-0123abcd", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if extracted.tools_called else "stop",
                         "stop_reason": matched}],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion_tokens,
                      "total_tokens": PROMPT_TOKENS + completion_tokens}})

    async def _sse(self, body: dict[str, Any], text: str, matched: Any):
        """Chorus' chat stream: role chunk, deltas (reasoning, content, tool calls), finish, usage, [DONE];
        continuous usage in every chunk."""
        reasoning = get_reasoning_parser("qwen3").streaming()
        tools = get_tool_parser("hermes", counting_ids("call_fake")).streaming()
        head = {"id": "chatcmpl-0123abcd", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}
        tokens = 0

        def chunk(delta: dict[str, Any], finish: Any = None, **extra: Any) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens,
                     "total_tokens": PROMPT_TOKENS + tokens}
            return "data: " + json.dumps({**head, "choices": [choice], "usage": usage}) + "\n\n"

        yield chunk({"role": "assistant", "content": ""})
        deltas = [text[i:i + 4] for i in range(0, len(text), 4)]
        if body["model"] == "fails-midway":
            yield chunk({"content": "Hel"})
            error = {"message": "The engine stopped.", "type": "InternalServerError", "param": None,
                     "code": 500}
            yield "data: " + json.dumps({"error": error}) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        for d in [*deltas, None]:
            tokens += d is not None
            r = reasoning.feed(d) if d is not None else reasoning.finish()
            if r.reasoning:
                yield chunk({"reasoning_content": r.reasoning})
            pieces = tools.feed(r.content or "") + (tools.finish() if d is None else [])
            for delta in to_openai_deltas(pieces):
                yield chunk(delta)
            await asyncio.sleep(0)
        yield chunk({}, "tool_calls" if tools.tools_called else "stop", stop_reason=matched)
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens,
                 "total_tokens": PROMPT_TOKENS + tokens}
        yield "data: " + json.dumps({**head, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def server():
    import uvicorn
    backend = FakeChatBackend()
    handler = AnthropicMessages(backend)
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(raw_request: Request):
        return await handler.create_message(raw_request)

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", backend
    srv.should_exit = True
    thread.join(30)


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="test-key", max_retries=0, timeout=30)


def test_text_message(client, server):
    msg = client.messages.create(model="tiny-llama", max_tokens=64, system="Be brief.",
                                 messages=[{"role": "user", "content": "Hi"}],
                                 extra_body={"temperature": 0.2, "top_k": 5})   # older SDKs' fields
    assert isinstance(msg, anthropic.types.Message)
    assert msg.id == "msg_0123abcd" and msg.role == "assistant" and msg.model == "tiny-llama"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello! How can I help you today?"
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (PROMPT_TOKENS, 7)
    sent = server[1].requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (sent["max_tokens"], sent["temperature"], sent["top_k"]) == (64, 0.2, 5)


def test_stop_sequence(client):
    msg = client.messages.create(model="tiny-llama", max_tokens=16, stop_sequences=["END"],
                                 messages=[{"role": "user", "content": "Count"}])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END")


def test_streamed_text(client):
    with client.messages.stream(model="tiny-llama", max_tokens=64,
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello! How can I help you today?"
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == text
    assert final.stop_reason == "end_turn" and final.id == "msg_0123abcd"
    assert final.usage.input_tokens == PROMPT_TOKENS and final.usage.output_tokens > 0


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    out = []
    for block in raw.split("\n\n"):
        if block:
            event_line, data_line = block.split("\n")
            assert event_line.startswith("event: ") and data_line.startswith("data: ")
            data = json.loads(data_line[6:])
            assert data["type"] == event_line[7:]
            out.append((event_line[7:], data))
    return out


def test_event_sequence(server):
    events = _events(server[0], {"model": "tiny-llama", "max_tokens": 64, "stream": True,
                                 "tools": [WEATHER_TOOL],
                                 "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    names = [name for name, _ in events]
    # thinking block, then the tool_use block
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "tool_use")]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "call_fake0", "name": "get_weather",
                                          "input": {}}
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]
    # each block's deltas lie between its start and its stop
    for index, kind in ((0, "thinking_delta"), (1, "input_json_delta")):
        start = [i for i, (n, d) in enumerate(events) if n == "content_block_start" and d["index"] == index]
        stop = [i for i, (n, d) in enumerate(events) if n == "content_block_stop" and d["index"] == index]
        at = [i for i, (n, d) in enumerate(events) if n == "content_block_delta" and d["index"] == index]
        assert at and all(events[i][1]["delta"]["type"] == kind for i in at)
        assert start[0] < at[0] and at[-1] < stop[0]
    arguments = "".join(d["delta"]["partial_json"] for n, d in events
                        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    message_start = events[0][1]["message"]
    assert message_start["usage"] == {"input_tokens": PROMPT_TOKENS, "output_tokens": 0}
    assert message_start["content"] == [] and message_start["stop_reason"] is None
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


def test_tool_round_trip(client, server):
    user = {"role": "user", "content": "What's the weather in Paris?"}
    first = client.messages.create(model="tiny-llama", max_tokens=128, tools=[WEATHER_TOOL],
                                   tool_choice={"type": "auto"}, messages=[user])
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == "The user wants weather."
    call = first.content[1]
    assert (call.id, call.name) == ("call_fake0", "get_weather")
    assert call.input == {"city": "Paris", "unit": "celsius"}
    sent = server[1].requests[-1]
    assert sent["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters":
                                                               WEATHER_TOOL["input_schema"],
                                                               "description": "Current weather in a city"}}]
    assert sent["tool_choice"] == "auto"

    second = client.messages.create(
        model="tiny-llama", max_tokens=128, tools=[WEATHER_TOOL],
        messages=[user, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": [{"type": "text", "text": "21 C, sunny"}]}]}])
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "It is 21 degrees in Paris (21 C, sunny)."
    sent = server[1].requests[-1]
    assert sent["messages"][1] == {
        "role": "assistant", "content": None, "reasoning_content": "The user wants weather.",
        "tool_calls": [{"id": "call_fake0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]}
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_fake0", "content": "21 C, sunny"}


def test_streamed_tool_use(client):
    with client.messages.stream(model="tiny-llama", max_tokens=128, tools=[WEATHER_TOOL],
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "The user wants weather."
    assert final.content[1].input == {"city": "Paris", "unit": "celsius"}


def test_tool_choice_mapping(client, server):
    client.messages.create(model="tiny-llama", max_tokens=8, tools=[WEATHER_TOOL],
                           tool_choice={"type": "tool", "name": "get_weather",
                                        "disable_parallel_tool_use": True},
                           messages=[{"role": "user", "content": "x"}])
    sent = server[1].requests[-1]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["parallel_tool_calls"] is False
    client.messages.create(model="tiny-llama", max_tokens=8, tools=[WEATHER_TOOL],
                           tool_choice={"type": "none"}, messages=[{"role": "user", "content": "x"}])
    assert server[1].requests[-1]["tool_choice"] == "none"


def test_image_blocks(client, server):
    client.messages.create(model="tiny-llama", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
        {"type": "text", "text": "What are these?"}]}])
    assert server[1].requests[-1]["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
        {"type": "text", "text": "What are these?"}]}]


@pytest.mark.parametrize("kwargs, error_class, status, error_type, message", [
    (dict(max_tokens=0), "BadRequestError", 400, "invalid_request_error", "max_tokens"),
    (dict(model="no-such-model"), "NotFoundError", 404, "not_found_error", "does not exist"),
    (dict(model="busy"), "ServiceUnavailableError", 503, "overloaded_error", "overloaded"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_wether"}), "BadRequestError", 400,
     "invalid_request_error", "names the function 'get_wether', which is not among the request's tools"),
    (dict(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                       "content": "y"}]}]),
     "BadRequestError", 400, "invalid_request_error",
     "messages[0].content[0]: a tool_result block cannot be in"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "BadRequestError", 400,
     "invalid_request_error", "server tool"),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "BadRequestError",
     400, "invalid_request_error", "messages.0.content"),
])
def test_errors_parse_as_sdk_exceptions(client, kwargs, error_class, status, error_type, message):
    args = dict(model="tiny-llama", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) | kwargs
    with pytest.raises(getattr(anthropic, error_class)) as e:
        client.messages.create(**args)
    assert e.value.status_code == status
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == error_type
    assert message in e.value.body["error"]["message"]
    if status == 503:
        assert e.value.response.headers["retry-after"] == "5"


def test_bad_json_body(server):
    r = httpx.post(server[0] + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]


def test_error_midstream_raises_in_the_sdk(client):
    stream = client.messages.stream(model="fails-midway", max_tokens=8,
                                    messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.APIStatusError) as e, stream as events:
        for _ in events:
            pass
    assert e.value.body["error"] == {"type": "api_error", "message": "The engine stopped."}
