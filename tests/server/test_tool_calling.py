"""Tool calling through the real server and the official OpenAI SDK (vLLM's flags: --enable-auto-tool-choice
--tool-call-parser hermes).

``required`` and named choices run the tiny random checkpoint under the tools' JSON-schema constraint, so
whatever it writes parses and validates (jsonschema); ``auto`` replies come from a scripted model
(``tests/server/scripted.py``: a random checkpoint never writes ``<tool_call>``), parsed by the real
server. Streamed tool-call deltas reassemble to the non-streamed answer; tools and tool results reach the
chat template; a bad ``tool_choice`` is a 400 that leaves nothing behind.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine.tool_calls.registry import get_tool_parser
from engine.tool_calls.tool_choice import resolve_tool_choice, tool_choice_schema
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import start_server
from tests.server.scripted import ScriptedReplies, assert_idle

MODEL = "tiny-tools"
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Write each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response id=\"{{ m.tool_call_id }}\">\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2.5's way, small: tools as JSON in a system turn, calls as <tool_call> JSON, results as
<tool_response>; ``arguments`` written with ``tojson`` (so it must be an object)."""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time now.",
    "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
AUTO_REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
              '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n'
              '</tool_call>')
"""A scripted hermes reply: content, then two parallel calls."""
CONSTRAINED_MAX_TOKENS = 160
SAMPLED = {"temperature": 1.0, "seed": 1234}
"""Seeded sampling for ``required`` with parallel calls: after each call the constraint allows ``,`` or
``]``, and greedy decoding of a random model may pick ``,`` forever; sampled, the list ends (the same way
for the same seed, streamed or not)."""


MAX_MODEL_LEN = 2048
"""Room for the tools' schemas in the prompt (the tiny tokenizer spends a token on ~2 characters)."""


def long_tiny_llama(tmp_path_factory: Any) -> str:
    """The tiny random llama with ``MAX_MODEL_LEN`` positions."""
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-long"), "llama",
                                     max_position_embeddings=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(long_tiny_llama(tmp_path_factory), served_model_name=[MODEL],
                       max_model_len=MAX_MODEL_LEN, chat_template=TOOLS_TEMPLATE,
                       enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=60)


def assert_valid_calls(message: Any, names: set[str], id_length: int = 29) -> list[tuple[str, dict]]:
    """Each call of ``message`` names one of ``names`` and its arguments parse and validate against that
    tool's schema; ids are OpenAI's (``call_`` + 24) or ``id_length`` letters and digits; returns (name,
    arguments)."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and len(call.id) == id_length, call
        assert call.id.startswith("call_") if id_length == 29 else call.id.isalnum(), call
        assert call.function.name in names, call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def reassemble(chunks: list[Any]) -> dict[str, Any]:
    """An OpenAI SDK chat stream -> {content, reasoning, calls [(id, name, arguments)], finish_reason}."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "finish_reason": finish,
            "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]}


def as_answer(choice: Any) -> dict[str, Any]:
    """A non-streamed choice in ``reassemble``'s shape."""
    return {"content": choice.message.content, "finish_reason": choice.finish_reason,
            "calls": [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]}


def without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "calls": [(name, arguments) for _, name, arguments in answer["calls"]]}


# ----------------------------------------------------------------------------------------------
# required / named: the real model under the tools' schema constraint
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_parse_and_follow_the_schemas(client, parallel):
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=parallel, max_tokens=CONSTRAINED_MAX_TOKENS,
                                          **SAMPLED)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = assert_valid_calls(choice.message, set(SCHEMAS))
    assert choice.message.content is None
    if not parallel:
        assert len(calls) == 1


def test_named_call_parses_and_follows_its_schema(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=CONSTRAINED_MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [name for name, _ in assert_valid_calls(choice.message, {"get_weather"})] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_constrained_calls_reassemble_to_the_non_streamed_answer(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=CONSTRAINED_MAX_TOKENS, **SAMPLED)
    full = client.chat.completions.create(**kwargs).choices[0]
    streamed = reassemble(list(client.chat.completions.create(**kwargs, stream=True)))
    assert without_ids(streamed) == without_ids(as_answer(full))
    assert streamed["finish_reason"] == "tool_calls"
    for _, name, arguments in streamed["calls"]:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_and_named_send_the_tools_schema_as_the_constraint(server, client):
    """What the engine is asked to enforce: vLLM's schema of the choice (a list of calls for required, at
    most one without parallel calls; the function's parameters for a named one)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [("required", True, '[{"name": "get_time", "parameters": {"utc": false}}]'),
             ("required", False, '[{"name": "get_time", "parameters": {"utc": false}}]'),
             (named, True, '{"city": "Oslo", "unit": "celsius"}')]
    for tool_choice, parallel, reply in cases:
        with ScriptedReplies(server, [reply]) as script:
            resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                  tool_choice=tool_choice, parallel_tool_calls=parallel,
                                                  max_tokens=64)
        choice = resolve_tool_choice(TOOLS, tool_choice, parallel, auto_enabled=True)
        expected = tool_choice_schema(TOOLS, choice)
        assert script.last.params.structured_outputs.json == expected
        assert ("maxItems" in expected) == (tool_choice == "required" and not parallel)
        assert_valid_calls(resp.choices[0].message, set(SCHEMAS))
        assert resp.choices[0].finish_reason == "tool_calls"


# ----------------------------------------------------------------------------------------------
# auto: calls read from free text (scripted replies)
# ----------------------------------------------------------------------------------------------
def test_auto_reads_parallel_hermes_calls(server, client):
    with ScriptedReplies(server, [AUTO_REPLY]) as script:
        resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"   # text outside the calls, verbatim
    assert assert_valid_calls(choice.message, set(SCHEMAS)) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"utc": True})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    params = script.last.params
    assert params.structured_outputs is None and params.skip_special_tokens   # hermes tags are plain text


@pytest.mark.parametrize("piece_sizes", [(1,), (2, 5, 3), (7, 1, 11), (1000,)])
def test_auto_stream_deltas_reassemble_to_the_non_streamed_answer(server, client, piece_sizes):
    with ScriptedReplies(server, [AUTO_REPLY], piece_sizes=piece_sizes):
        full = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              max_tokens=64).choices[0]
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                                     stream=True))
    streamed = reassemble(chunks)
    assert without_ids(streamed) == without_ids(as_answer(full))
    assert streamed["finish_reason"] == "tool_calls" and len(streamed["calls"]) == 2
    assert all(cid.startswith("call_") for cid, _, _ in streamed["calls"])
    first_deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [] if d.id]
    assert [(d.index, d.type, d.function.name) for d in first_deltas] == [(0, "function", "get_weather"),
                                                                          (1, "function", "get_time")]
    for d, (_, _, arguments) in zip(first_deltas, streamed["calls"]):   # what was written by then
        assert arguments.startswith(d.function.arguments)
    later = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [] if not d.id]
    assert all(d.function.name is None and d.type is None for d in later)


def test_a_format_whose_tags_are_special_tokens_keeps_them_in_the_text(server, client, monkeypatch):
    """--tool-call-parser mistral: ``[TOOL_CALLS]`` is a special token, so the reply is detokenized with
    ``skip_special_tokens=False``; Mistral's 9-character call ids."""
    monkeypatch.setattr(server.app.state.serving.chat, "tool_parser", get_tool_parser("mistral"))
    reply = '[TOOL_CALLS][{"name": "get_time", "arguments": {"utc": true}}]'
    with ScriptedReplies(server, [reply]) as script:
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=64).choices[0]
    assert script.last.params.skip_special_tokens is False
    assert assert_valid_calls(choice.message, set(SCHEMAS), id_length=9) == [("get_time", {"utc": True})]
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("piece_sizes", [(1,), (1000,)])
def test_auto_without_parallel_calls_keeps_the_first_call(server, client, piece_sizes):
    """``parallel_tool_calls: false`` with ``auto``: the reply's first call only, whole and streamed."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, parallel_tool_calls=False)
    with ScriptedReplies(server, [AUTO_REPLY], piece_sizes=piece_sizes):
        full = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert full.finish_reason == "tool_calls" and full.message.content == "Let me check.\n"
    assert assert_valid_calls(full.message, set(SCHEMAS)) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    streamed = reassemble(chunks)
    assert without_ids(streamed) == without_ids(as_answer(full)) and len(streamed["calls"]) == 1
    assert {d.index for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []} == {0}


def test_auto_reply_without_calls_is_content(server, client):
    with ScriptedReplies(server, ["It is sunny in Paris."]):
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=64).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("It is sunny in Paris.", "stop")
    assert not choice.message.tool_calls


def test_a_call_cut_by_length_keeps_finish_reason_length(server, client):
    with ScriptedReplies(server, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'],
                         finish_reason="length"):
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=16).choices[0]
    assert choice.finish_reason == "length"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_tool_choice_none_reads_no_calls_but_the_template_gets_the_tools(server, client):
    with ScriptedReplies(server, [AUTO_REPLY]) as script:
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=64).choices[0]
    assert (choice.message.content, choice.finish_reason) == (AUTO_REPLY, "stop")
    assert not choice.message.tool_calls
    assert json.dumps(WEATHER) in script.last.prompt["prompt"]


def test_tool_results_go_back_through_the_chat_template(server, client):
    """The second turn: the assistant's calls (``arguments`` a JSON string, given to the template as an
    object) and the tool's result with its ``tool_call_id``."""
    with ScriptedReplies(server, [AUTO_REPLY, "It is 21 degrees and 10:00 UTC."]) as script:
        first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64)
        message = first.choices[0].message
        history = ASK + [message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": i})}
            for i, call in enumerate(message.tool_calls)]
        second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=64)
    assert second.choices[0].message.content == "It is 21 degrees and 10:00 UTC."
    assert second.choices[0].finish_reason == "stop"
    prompt = script.last.prompt["prompt"]
    weather, clock = message.tool_calls
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>') in prompt
    assert '{"name": "get_time", "arguments": {"utc": true}}' in prompt
    assert f'<tool_response id="{weather.id}">\n{{"result": 0}}\n</tool_response>' in prompt
    assert f'<tool_response id="{clock.id}">\n{{"result": 1}}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tokenize_renders_the_tools_too(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                   "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]},
                      timeout=30).json()["prompt"]
    assert json.dumps(CLOCK) in text


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
def test_unknown_function_is_a_400_with_its_reason_and_nothing_is_held(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})
    err = e.value.body
    assert err["param"] == "tool_choice"
    assert "'get_stock'" in err["message"] and "'get_weather'" in err["message"]
    assert e.value.status_code == 400
    assert_idle(server)
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert_idle(server)


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "'retrieval'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "name"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages", "arguments is not valid JSON"),
])
def test_bad_tool_fields_are_400s_naming_the_field(server, body, param, words):
    r = httpx.post(server.base_url + "/chat/completions",
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert_idle(server)


def test_auto_needs_the_server_flags(llama_server):
    """vLLM's rule: tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice and
    --tool-call-parser; the other choices need neither."""
    client = openai.OpenAI(base_url=llama_server.base_url, api_key="EMPTY", max_retries=0)
    for tool_choice in (openai.NOT_GIVEN, "auto"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS,
                                           tool_choice=tool_choice, max_tokens=4)
        assert e.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in e.value.body["message"]
    resp = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=4, temperature=0)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


def test_auto_tool_choice_flag_needs_a_parser():
    """vLLM's start-up rule, and the parser names argparse takes."""
    import argparse

    from engine.server.args import add_serve_args, check_serve_args, make_serve_namespace
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        check_serve_args(make_serve_namespace(enable_auto_tool_choice=True))
    check_serve_args(make_serve_namespace(enable_auto_tool_choice=True, tool_call_parser="mistral"))
    parser = add_serve_args(argparse.ArgumentParser(exit_on_error=False))
    args = parser.parse_args(["--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1"])
    assert (args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice) == (
        "llama3_json", "deepseek_r1", False)
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--tool-call-parser", "pythonic"])
