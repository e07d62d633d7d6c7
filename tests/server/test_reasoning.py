"""--reasoning-parser through the real server and the OpenAI SDK: the ``<think>`` part of a reply goes to
``reasoning_content``, streamed (``delta.reasoning_content``) and not, the deltas reassembling to the whole
reply's split; where the reply starts (in reasoning or not) follows the rendered prompt; reasoning and
``auto`` tool calls together. Replies with think tags come from a scripted model
(``tests/server/scripted.py``); the tiny random checkpoint's own replies (no tags) stay content.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.server.conftest import start_server
from tests.server.scripted import ScriptedReplies

MODEL = "tiny-reasoning"
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif force_thinking is defined and force_thinking %}<think>\n{% endif %}{% endif %}")
"""Qwen3's switches: ``enable_thinking: false`` closes an empty think block in the prompt (the reply is
content); ``force_thinking`` (the thinking models' templates) opens one (the reply starts in reasoning)."""
ASK = [{"role": "user", "content": "Is 17 prime?"}]
REPLY = "<think>Check 2, 3 and 4: none divides 17.</think>\n\nYes, 17 is prime."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_thinking_dir):
    srv = start_server(str(tiny_thinking_dir), served_model_name=[MODEL], max_model_len=256,
                       chat_template=THINKING_TEMPLATE, reasoning_parser="qwen3",
                       enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=60)


def reasoning_of(message: Any) -> Any:
    """``reasoning_content`` of an SDK message or delta (an extra field to the SDK's models)."""
    return (message.model_extra or {}).get("reasoning_content")


def reassemble(chunks: list[Any]) -> tuple[Any, Any, list[tuple[str, str]], Any]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                name, arguments = calls.get(d.index, ("", ""))
                calls[d.index] = (name + (d.function.name or ""), arguments + (d.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish


def test_reasoning_content_non_streamed(server, client):
    with ScriptedReplies(server, [REPLY]):
        choice = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64).choices[0]
    assert reasoning_of(choice.message) == "Check 2, 3 and 4: none divides 17."
    assert choice.message.content == "\n\nYes, 17 is prime."
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("piece_sizes", [(1,), (3,), (4, 9, 2), (500,)])
def test_streamed_reasoning_reassembles_to_the_non_streamed_split(server, client, piece_sizes):
    with ScriptedReplies(server, [REPLY], piece_sizes=piece_sizes):
        full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64).choices[0]
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, stream=True))
    assert reassemble(chunks) == (reasoning_of(full.message), full.message.content, [], "stop")
    deltas = [c.choices[0].delta for c in chunks[1:] if c.choices]
    kinds = ["reasoning" if reasoning_of(d) else "content" for d in deltas if reasoning_of(d) or d.content]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] == "reasoning"   # all reasoning, then content
    assert all("<think>" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


@pytest.mark.parametrize("kwargs, reply, expected", [
    ({"enable_thinking": False}, "Yes.", (None, "Yes.")),
    ({"force_thinking": True}, "Odd, not 3k.</think>Yes.", ("Odd, not 3k.", "Yes.")),
    ({}, "Yes, no tags.", (None, "Yes, no tags.")),
])
def test_where_the_reply_starts_follows_the_prompt(server, client, kwargs, reply, expected):
    with ScriptedReplies(server, [reply]) as script:
        choice = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64,
                                                extra_body={"chat_template_kwargs": kwargs}).choices[0]
        streamed = reassemble(list(client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=64, stream=True,
            extra_body={"chat_template_kwargs": kwargs})))
    assert (reasoning_of(choice.message), choice.message.content) == expected
    assert streamed[:2] == expected
    if kwargs.get("force_thinking"):
        assert script.last.prompt["prompt"].endswith("<think>\n")


def test_reasoning_then_tool_calls(server, client):
    reply = ('<think>The user wants the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>')
    with ScriptedReplies(server, [reply], piece_sizes=(2, 5)):
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                max_tokens=64).choices[0]
        streamed = reassemble(list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                                  max_tokens=64, stream=True)))
    assert reasoning_of(choice.message) == "The user wants the weather."
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert streamed == ("The user wants the weather.", None, [("get_weather", call.function.arguments)],
                        "tool_calls")


def test_the_models_own_replies_stream_as_they_answer(client):
    """The real engine (no scripted replies): a reply without tags is content, streamed or not (greedy)."""
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0]
    streamed = reassemble(list(client.chat.completions.create(**kwargs, stream=True)))
    assert full.message.content and not full.message.content.startswith("<think>")
    assert reasoning_of(full.message) is None
    assert streamed == (None, full.message.content, [], "length")


def test_a_constrained_reply_reasons_first_where_the_prompt_opens_reasoning(client):
    """A named tool choice under its schema constraint (the real engine, --reasoning-parser in the engine
    too): with the prompt left inside ``<think>`` the reply reasons unconstrained first (the random model
    never closes it: all of it is reasoning, cut at max_tokens); with the prompt closing the think block
    the constraint applies from the first token and the reply is the call."""
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"], "additionalProperties": False}}}
    kwargs = dict(model=MODEL, messages=ASK, tools=[pick], tool_choice={"type": "function", "function": {
        "name": "pick"}}, temperature=0, max_tokens=32)
    thinking = client.chat.completions.create(
        **kwargs, extra_body={"chat_template_kwargs": {"force_thinking": True}}).choices[0]
    assert thinking.finish_reason == "length" and reasoning_of(thinking.message)
    assert not thinking.message.tool_calls and not thinking.message.content
    choice = client.chat.completions.create(
        **kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert choice.finish_reason == "tool_calls" and reasoning_of(choice.message) is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "pick"
    assert json.loads(call.function.arguments)["color"] in ("red", "green", "blue")


def test_streamed_logprobs_cover_every_token_while_parsing(client):
    """With a parser some deltas are held back (a possible tag); every token's logprob is still sent once."""
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert len(streamed) == len(full.logprobs.content) == 12
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in full.logprobs.content]
