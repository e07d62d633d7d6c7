"""``--tool-call-parser hermes``: Hermes / Qwen2.5 / Qwen3 calls, each a JSON object between tags::

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Several blocks are parallel calls; text outside the blocks is content. In a block, what follows the
object up to ``</tool_call>`` is dropped; a ``</tool_call>`` before the object closes ends the call
there. A block whose object is not a call (``object_call``) is content, tags included. ``<tool_call>``
is an added token that is not special in Qwen's tokenizers, so the default detokenization keeps it.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from engine.tool_calls.ids import IdFactory, openai_tool_call_id
from engine.tool_calls.json_scan import WHITESPACE
from engine.tool_calls.object_call import CallStatus, ObjectCall
from engine.tool_calls.parser import StreamingToolParser, ToolParserBase, partial_tag_length

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _Mode(Enum):
    CONTENT = "content"
    BLOCK_START = "after <tool_call>"
    IN_CALL = "in the call's object"
    AFTER_CALL = "after the object, before </tool_call>"


class HermesStreamingParser(StreamingToolParser):
    """One reply in the Hermes format (see the module doc)."""

    def __init__(self, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._mode = _Mode.CONTENT
        self._block_head = ""
        """The tag and whitespace that opened the current block (content again if it is no call)."""
        self._call: Optional[ObjectCall] = None

    def _consume(self, final: bool) -> None:
        while True:
            mode, text = self._mode, self._pending
            if mode is _Mode.CONTENT:
                at = text.find(OPEN_TAG)
                if at >= 0:
                    self.emit_content(text[:at])
                    self._pending = text[at + len(OPEN_TAG):]
                    self._block_head, self._mode = OPEN_TAG, _Mode.BLOCK_START
                    continue
                keep = 0 if final else partial_tag_length(text, OPEN_TAG)
                self.emit_content(text[:len(text) - keep])
                self._pending = text[len(text) - keep:]
                return
            if mode is _Mode.BLOCK_START:
                body = text.lstrip(WHITESPACE)
                self._block_head += text[:len(text) - len(body)]
                self._pending = body
                if body.startswith("{"):
                    self._call, self._mode = ObjectCall(self), _Mode.IN_CALL
                    continue
                if not body and not final:
                    return
                self._not_a_call("")
                continue
            if mode is _Mode.IN_CALL:
                assert self._call is not None
                at = text.find(CLOSE_TAG)
                end = at if at >= 0 else len(text) - (0 if final else partial_tag_length(text, CLOSE_TAG))
                used = self._call.feed(text[:end])
                self._pending = text[used:]
                if self._call.status is CallStatus.RUNNING and (at >= 0 or final):
                    self._call.cut()
                if self._call.status is CallStatus.DONE:
                    self._mode = _Mode.AFTER_CALL
                    continue
                if self._call.status is CallStatus.REJECTED:
                    self._not_a_call(self._call.leftover)
                    continue
                return
            # AFTER_CALL: skip to the closing tag
            at = text.find(CLOSE_TAG)
            if at >= 0:
                self._pending = text[at + len(CLOSE_TAG):]
                self._mode = _Mode.CONTENT
                continue
            self._pending = "" if final else text[len(text) - partial_tag_length(text, CLOSE_TAG):]
            return

    def _not_a_call(self, consumed: str) -> None:
        """The block holds no call: its head is content and its text is read again as content."""
        self.emit_content(self._block_head)
        self._pending = consumed + self._pending
        self._block_head, self._call, self._mode = "", None, _Mode.CONTENT


class HermesToolParser(ToolParserBase):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    needs_special_tokens = False

    @staticmethod
    def default_id_factory() -> IdFactory:
        return openai_tool_call_id

    def streaming(self) -> HermesStreamingParser:
        return HermesStreamingParser(self.id_factory)
