"""Our chat-completion stream (chunks as dicts) -> Anthropic's SSE event sequence::

    message_start
    content_block_start (index 0) / ping / content_block_delta ... / content_block_stop
    content_block_start (index 1) / content_block_delta ... / content_block_stop
    ...
    message_delta (stop_reason, stop_sequence, usage) / message_stop

each written ``event: NAME\\ndata: JSON\\n\\n``. ``delta.reasoning_content`` (or ``reasoning``) opens a
thinking block (``thinking_delta``), ``delta.content`` a text block (``text_delta``), a tool-call delta
with an ``id`` a tool_use block whose arguments follow as ``input_json_delta``; a change of kind closes the
open block. ``ping`` follows the first block's start (or precedes ``message_delta`` when there is no
block). Input tokens come from the chunks' ``usage`` (the translated request asks for it in every
chunk); output tokens from the last ``usage`` seen. An in-band error chunk (``{"error": {...}}``)
becomes an ``error`` event in Anthropic's shape and ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any, Optional, Union

from engine.server.anthropic.errors import anthropic_error_body
from engine.server.anthropic.translate import message_id, stop_reason

SSE_DONE_DATA = "[DONE]"


def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event, Anthropic's framing."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def chunks_from_sse(source: AsyncIterable[Union[str, bytes]]) -> AsyncIterator[dict[str, Any]]:
    """The chunk dicts of an OpenAI SSE stream (``data: {...}\\n\\n`` strings, split anywhere), up to
    ``data: [DONE]``."""
    buffer = ""
    async for piece in source:
        buffer += piece.decode("utf-8") if isinstance(piece, bytes) else piece
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            data = "\n".join(line[5:].lstrip(" ") for line in event.splitlines() if line.startswith("data:"))
            if not data:
                continue
            if data == SSE_DONE_DATA:
                return
            yield json.loads(data)


class _Blocks:
    """The content blocks of the message being streamed: which one is open, and of what kind."""

    def __init__(self) -> None:
        self.count = 0
        """Blocks started so far (the next block's index)."""
        self.open_kind: Optional[str] = None
        """``thinking``, ``text`` or ``tool_use``; None when no block is open."""
        self.open_call: Optional[int] = None
        """The chat tool-call index of the open tool_use block."""
        self.call_blocks: dict[int, int] = {}
        """Chat tool-call index -> block index."""
        self.pinged = False

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind, self.open_call = None, None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        events.append(sse("content_block_start", {"type": "content_block_start", "index": self.count,
                                                  "content_block": block}))
        if not self.pinged:
            self.pinged = True
            events.append(sse("ping", {"type": "ping"}))
        self.open_kind = kind
        self.count += 1
        return events

    def delta(self, index: int, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


async def anthropic_events(chunks: AsyncIterable[dict[str, Any]], *, model: str,
                           stop_sequences: Optional[Sequence[str]] = None,
                           input_tokens: int = 0) -> AsyncIterator[str]:
    """Anthropic's SSE events for a chat-completion stream of one choice (see the module doc).

    Args:
        chunks: the chat-completion chunks, as dicts (``chunks_from_sse`` reads them from SSE text).
        model: the ``model`` of ``message_start`` until a chunk names it.
        stop_sequences: the request's ``stop_sequences`` (a matched one is reported as such).
        input_tokens: prompt tokens for ``message_start`` when the first chunk carries no usage.
    """
    blocks = _Blocks()
    started = False
    usage = {"input_tokens": input_tokens, "output_tokens": 0}
    finish: Optional[str] = None
    matched_stop: Any = None
    async for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            for event in blocks.close():
                yield event
            yield sse("error", anthropic_error_body(int(error.get("code") or 500),
                                                    str(error.get("message", "The request failed."))))
            return
        if chunk.get("usage"):
            usage["input_tokens"] = chunk["usage"].get("prompt_tokens", usage["input_tokens"])
            usage["output_tokens"] = chunk["usage"].get("completion_tokens", usage["output_tokens"])
        if not started:
            started = True
            yield sse("message_start", {"type": "message_start", "message": {
                "id": message_id(chunk.get("id")), "type": "message", "role": "assistant", "content": [],
                "model": chunk.get("model") or model, "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}})
        for choice in chunk.get("choices") or []:
            for event in _choice_events(blocks, choice.get("delta") or {}):
                yield event
            if choice.get("finish_reason") is not None:
                finish, matched_stop = choice["finish_reason"], choice.get("stop_reason")
    if not started:
        yield sse("message_start", {"type": "message_start", "message": {
            "id": message_id(None), "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens,
                                                                   "output_tokens": 0}}})
    for event in blocks.close():
        yield event
    if not blocks.pinged:
        yield sse("ping", {"type": "ping"})
    reason, sequence = stop_reason(finish, matched_stop, stop_sequences, bool(blocks.call_blocks))
    yield sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": {"input_tokens": usage["input_tokens"],
                                          "output_tokens": usage["output_tokens"]}})
    yield sse("message_stop", {"type": "message_stop"})


def _choice_events(blocks: _Blocks, delta: dict[str, Any]) -> list[str]:
    events: list[str] = []
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if reasoning:
        if blocks.open_kind != "thinking":
            events += blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        events.append(blocks.delta(blocks.count - 1, {"type": "thinking_delta", "thinking": reasoning}))
    if delta.get("content"):
        if blocks.open_kind != "text":
            events += blocks.start("text", {"type": "text", "text": ""})
        events.append(blocks.delta(blocks.count - 1, {"type": "text_delta", "text": delta["content"]}))
    for call in delta.get("tool_calls") or []:
        index = call.get("index", 0)
        function = call.get("function") or {}
        if call.get("id") is not None and index not in blocks.call_blocks:
            events += blocks.start("tool_use", {"type": "tool_use", "id": call["id"],
                                                "name": function.get("name") or "", "input": {}})
            blocks.open_call = index
            blocks.call_blocks[index] = blocks.count - 1
        arguments = function.get("arguments")
        if arguments and index in blocks.call_blocks:
            events.append(blocks.delta(blocks.call_blocks[index],
                                       {"type": "input_json_delta", "partial_json": arguments}))
    return events
