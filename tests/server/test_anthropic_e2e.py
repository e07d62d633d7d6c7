"""POST /v1/messages on the real server (tiny random checkpoint, an API key, --enable-auto-tool-choice
--tool-call-parser hermes) through the official ``anthropic`` SDK: text replies equal the chat route's,
streamed and not; a tool round trip (a named tool under the schema constraint, and ``auto`` calls of a
scripted model whose results go back through the chat template); stop sequences; the key as
``x-api-key``; every error in Anthropic's shape, the SDK raising the matching class; a stream the client
leaves frees its request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine.request_limits import EngineOverloadedError
from tests.server.conftest import start_server
from tests.server.scripted import ScriptedReplies, assert_idle
from tests.server.test_tool_calling import MAX_MODEL_LEN, TOOLS_TEMPLATE, long_tiny_llama

anthropic = pytest.importorskip("anthropic")

MODEL = "tiny-anthropic"
KEY = "sk-anthropic-e2e"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "The time now.",
         "input_schema": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                          "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
"""Sampling fields this SDK no longer has a parameter for (the server takes them)."""
AUTO_REPLY = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
              '"celsius"}}\n</tool_call><tool_call>\n{"name": "get_time", "arguments": {"utc": false}}\n'
              '</tool_call>')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(long_tiny_llama(tmp_path_factory), served_model_name=[MODEL],
                       max_model_len=MAX_MODEL_LEN, api_key=KEY, chat_template=TOOLS_TEMPLATE,
                       enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def blocks(message: Any) -> list[tuple[str, Any]]:
    """A message's content as (type, payload) pairs, tool ids left out."""
    out = []
    for b in message.content:
        out.append((b.type, b.text if b.type == "text" else (b.name, b.input) if b.type == "tool_use"
                    else b.thinking))
    return out


def test_text_message_is_the_chat_completions_reply(server, client):
    msg = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=ASK,
                                 extra_body=GREEDY)
    chat = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}] + ASK)
    assert isinstance(msg, anthropic.types.Message)
    assert msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert blocks(msg) == [("text", chat.choices[0].message.content)]
    expected_stop = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (msg.stop_reason, msg.stop_sequence) == (expected_stop, None)
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)


def test_streamed_text_is_the_message(client):
    kwargs = dict(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    msg = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [("text", text)] == blocks(final) == blocks(msg)
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens == msg.usage.input_tokens


def test_named_tool_round_trip(client):
    """tool_choice ``tool``: the reply is a tool_use whose input follows the tool's schema; its result goes
    back and the next turn is served."""
    msg = client.messages.create(model=MODEL, max_tokens=96, messages=ASK, tools=[WEATHER, CLOCK],
                                 tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    follow_up = client.messages.create(
        model=MODEL, max_tokens=8, tools=[WEATHER, CLOCK], tool_choice={"type": "none"}, extra_body=GREEDY,
        messages=ASK + [{"role": "assistant", "content": msg.content},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "21 degrees"}]}])
    # The random model's next turn is text (no block when it is only whitespace), never a tool call.
    assert {b.type for b in follow_up.content} <= {"text"} and follow_up.usage.output_tokens > 0
    assert follow_up.stop_reason in ("max_tokens", "end_turn")


def test_auto_tool_round_trip_renders_the_results(server, client):
    with ScriptedReplies(server, [AUTO_REPLY, "Oslo: 3 degrees, 08:00."]) as script:
        msg = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER, CLOCK])
        uses = [b for b in msg.content if b.type == "tool_use"]
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": f"result {i}"}
                   for i, u in enumerate(uses)]
        final = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER, CLOCK], messages=ASK + [
            {"role": "assistant", "content": msg.content}, {"role": "user", "content": results}])
    assert blocks(msg) == [("text", "Checking."),
                           ("tool_use", ("get_weather", {"city": "Oslo", "unit": "celsius"})),
                           ("tool_use", ("get_time", {"utc": False}))]
    assert msg.stop_reason == "tool_use"
    assert blocks(final) == [("text", "Oslo: 3 degrees, 08:00.")] and final.stop_reason == "end_turn"
    prompt = script.last.prompt["prompt"]
    assert '"arguments": {"city": "Oslo", "unit": "celsius"}' in prompt
    for i, use in enumerate(uses):
        assert f'<tool_response id="{use.id}">\nresult {i}\n</tool_response>' in prompt
    assert json.dumps(CLOCK["input_schema"]) in prompt   # the tools, as OpenAI function parameters


@pytest.mark.parametrize("piece_sizes", [(1,), (4, 7), (1000,)])
def test_streamed_tool_use_is_the_message(server, client, piece_sizes):
    with ScriptedReplies(server, [AUTO_REPLY], piece_sizes=piece_sizes):
        msg = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER, CLOCK])
        with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK,
                                    tools=[WEATHER, CLOCK]) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
    assert blocks(final) == blocks(msg) and final.stop_reason == msg.stop_reason == "tool_use"
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop") == 3


def test_stop_sequence(server, client):
    with ScriptedReplies(server, ["Counting: 1 2 3"], stop_reason="END") as script:
        msg = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=["END"])
        with client.messages.stream(model=MODEL, max_tokens=16, messages=ASK,
                                    stop_sequences=["END"]) as stream:
            final = stream.get_final_message()
    assert script.last.params.stop == ["END"]
    expected = ("stop_sequence", "END")
    assert (msg.stop_reason, msg.stop_sequence) == (final.stop_reason, final.stop_sequence) == expected


# ----------------------------------------------------------------------------------------------
# keys and errors
# ----------------------------------------------------------------------------------------------
def test_a_wrong_key_is_an_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "Unauthorized: missing or invalid API key."}}
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)   # Authorization: Bearer
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=ASK).content


def _error(e: Any, kind: str, words: str) -> None:
    assert e.body["type"] == "error" and e.body["error"]["type"] == kind, e.body
    assert words in e.body["error"]["message"], e.body


def test_errors_have_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    _error(e.value, "not_found_error", "no-such-model")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_stock"})
    _error(e.value, "invalid_request_error", "'get_stock'")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    _error(e.value, "invalid_request_error", "does not take images")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    _error(e.value, "invalid_request_error", "max_tokens")
    auth = {"x-api-key": KEY}
    for method, body, status, words in [("POST", b"{not json", 400, "not valid JSON"),
                                        ("POST", b"[1]", 400, "JSON object"),
                                        ("GET", None, 405, "Method Not Allowed")]:
        r = httpx.request(method, server.url + "/v1/messages", content=body, timeout=30,
                          headers={**auth, "content-type": "application/json"})
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and words in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/messages", json={}, headers={**auth, "X-Request-Id": "bad id!"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert_idle(server)


def test_an_overloaded_engine_is_overloaded_error(server, client):
    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise EngineOverloadedError("The engine is overloaded: retry later.")

    server.engine_client.add_request = refuse
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    finally:
        del server.engine_client.add_request
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
    _error(e.value, "overloaded_error", "overloaded")


def test_a_stream_the_client_leaves_frees_its_request(server, client):
    """The request is aborted (not run to its end: no finished request is counted) and frees its blocks."""
    client.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    finished = server.metric("chorus:request_success_total")
    body = {"model": MODEL, "max_tokens": 1500, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    assert_idle(server)
    assert server.metric("chorus:request_success_total") == finished
