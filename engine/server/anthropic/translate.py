"""Anthropic Messages <-> OpenAI chat completions: a ``MessagesRequest`` becomes the chat-completion request
dict ``/v1/chat/completions`` takes, and a chat completion (dict) becomes a ``Message``.

Request mapping:

- ``system`` (a string or text blocks, joined with newlines) -> the first message, ``role: system``;
- user text and image blocks -> content parts (``text``, ``image_url`` with a ``data:`` URL for base64
  sources or the source's URL); ``tool_result`` blocks -> ``role: tool`` messages (``tool_call_id``)
  placed before the user's other parts, their text joined with newlines and prefixed ``Error: `` when
  ``is_error``; their images go to the user message that follows;
- assistant text -> ``content``, ``tool_use`` -> ``tool_calls`` (``arguments``: the input as JSON),
  ``thinking`` -> ``reasoning_content`` (which reasoning templates read); ``redacted_thinking`` is left out;
- ``tools`` -> function tools (``input_schema`` -> ``parameters``); ``tool_choice`` ``auto`` / ``any`` /
  ``tool`` / ``none`` -> ``auto`` / ``required`` / the named function / ``none``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
- ``stop_sequences`` -> ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``model``,
  ``stream`` as they are (a stream asks for usage in every chunk); ``metadata.user_id`` -> ``user``;
  ``thinking`` -> ``chat_template_kwargs.enable_thinking``; ``output_config.format`` (a JSON schema) ->
  ``response_format`` ``json_schema``.

Reply mapping: ``reasoning_content`` -> a thinking block, ``content`` -> a text block, each tool call ->
a tool_use block (``input``: the arguments parsed; ``{}`` when they are not a JSON object, as in a reply
cut by ``max_tokens``); ``finish_reason`` ``stop`` / ``length`` / ``tool_calls`` -> ``stop_reason``
``end_turn`` (``stop_sequence`` when the matched stop string is one of ``stop_sequences``) /
``max_tokens`` / ``tool_use``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Optional

from engine.server.anthropic.protocol import (
    ImageBlockParam,
    Message,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlockParam,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    Usage,
)

TOOL_ERROR_PREFIX = "Error: "
"""Put before the text of a ``tool_result`` with ``is_error`` (the chat template has no other way to say)."""
_ID_CHARS = re.compile(r"[^A-Za-z0-9]")


def image_url(block: ImageBlockParam) -> str:
    """An image block's source as an OpenAI ``image_url``: a data URL for base64, else the URL."""
    source = block.source
    if source.type == "base64":
        return f"data:{source.media_type};base64,{source.data}"
    return source.url


def _image_part(block: ImageBlockParam) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": image_url(block)}}


def _tool_result(block: ToolResultBlockParam, images: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``role: tool`` message of a tool result; its images are appended to ``images``."""
    if isinstance(block.content, list):
        texts = []
        for part in block.content:
            if isinstance(part, TextBlockParam):
                texts.append(part.text)
            else:
                images.append(_image_part(part))
        text = "\n".join(texts)
    else:
        text = block.content or ""
    if block.is_error:
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _user_messages(message: MessageParam, where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlockParam):
            parts.append(_image_part(block))
        elif isinstance(block, ToolResultBlockParam):
            out.append(_tool_result(block, images))
        else:
            raise ValueError(f"{where}.content[{j}]: a {block.type} block belongs in an assistant message.")
    if images or parts:
        out.append({"role": "user", "content": images + parts})
    return out


def _assistant_message(message: MessageParam, where: str) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlockParam):
            reasoning.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlockParam):
            raise ValueError(f"{where}.content[{j}]: a {block.type} block cannot be in an assistant message "
                             "(images and tool results are sent by the user).")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def to_chat_request(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completion request body (a dict for ``ChatCompletionRequest``) of a Messages request."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if message.role == "user":
            messages.extend(_user_messages(message, where))
        else:
            messages.append(_assistant_message(message, where))
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    for field in ("temperature", "top_p", "top_k"):
        value = getattr(req, field)
        if value is not None:
            body[field] = value
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.json_schema
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if req.tools:
        body["tools"] = [{"type": "function",
                          "function": {"name": t.name, "parameters": t.input_schema,
                                       **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "any":
            body["tool_choice"] = "required"
        elif choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = choice.type
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def message_id(chat_id: Optional[str]) -> str:
    """``msg_`` + the chat completion id's letters and digits (its ``chatcmpl-`` prefix dropped), so both
    name the same request in logs; a fresh id when there is none."""
    core = _ID_CHARS.sub("", (chat_id or "").removeprefix("chatcmpl-"))
    return "msg_" + (core or uuid.uuid4().hex)


def stop_reason(finish_reason: Optional[str], matched_stop: Any, stop_sequences: Optional[Sequence[str]],
                tools_called: bool) -> tuple[StopReason, Optional[str]]:
    """(``stop_reason``, ``stop_sequence``) of a chat completion's ``finish_reason`` and matched stop."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or tools_called:
        return "tool_use", None
    if isinstance(matched_stop, str) and stop_sequences and matched_stop in stop_sequences:
        return "stop_sequence", matched_stop
    return "end_turn", None


def tool_input(arguments: Optional[str]) -> dict[str, Any]:
    """A tool call's arguments as Anthropic's ``input`` object (``{}`` unless they are a JSON object)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def to_anthropic_message(completion: dict[str, Any],
                         stop_sequences: Optional[Sequence[str]] = None) -> Message:
    """A chat completion (``/v1/chat/completions``' JSON, one choice) as Anthropic's ``Message``."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    content: list[Any] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        content.append(ThinkingBlock(thinking=reasoning))
    if message.get("content"):
        content.append(TextBlock(text=message["content"]))
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append(ToolUseBlock(id=call.get("id") or f"toolu_{uuid.uuid4().hex}",
                                    name=function.get("name", ""),
                                    input=tool_input(function.get("arguments"))))
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences,
                                   bool(calls))
    usage = completion.get("usage") or {}
    return Message(id=message_id(completion.get("id")), content=content, model=completion.get("model", ""),
                   stop_reason=reason, stop_sequence=sequence,
                   usage=Usage(input_tokens=usage.get("prompt_tokens", 0),
                               output_tokens=usage.get("completion_tokens", 0)))
