"""``--tool-call-parser llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calls::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

Calls are recognized only at the start of the reply (after whitespace): ``<|python_tag|>`` (optional)
then one or more call objects separated by ``;``. A reply that starts otherwise is all content, as is a
first object that is not a call (a JSON answer: its first key is not a call key, or it has no string
``name``). Text after the last call that does not continue the list is content. ``<|python_tag|>`` is
a special token: requests parsed with this format are detokenized with ``skip_special_tokens=False``.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from engine.tool_calls.ids import IdFactory, openai_tool_call_id
from engine.tool_calls.json_scan import WHITESPACE
from engine.tool_calls.object_call import CallStatus, ObjectCall
from engine.tool_calls.parser import StreamingToolParser, ToolParserBase

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class _Mode(Enum):
    START = "start of the reply"
    OBJECT = "before a call object"
    IN_CALL = "in a call object"
    BETWEEN = "after a call"
    CONTENT = "content to the end"


class Llama3JsonStreamingParser(StreamingToolParser):
    """One reply in the Llama 3 JSON format (see the module doc)."""

    def __init__(self, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._mode = _Mode.START
        self._head = ""
        """Text consumed since the last call (tag, whitespace, separator): content if no call follows."""
        self._call: Optional[ObjectCall] = None

    def _consume(self, final: bool) -> None:
        while True:
            mode, text = self._mode, self._pending
            if mode is _Mode.CONTENT:
                self.emit_content(text)
                self._pending = ""
                return
            if mode is _Mode.START:
                body = text.lstrip(WHITESPACE)
                if body.startswith(PYTHON_TAG):
                    self._head = text[:len(text) - len(body) + len(PYTHON_TAG)]
                    self._pending = body[len(PYTHON_TAG):]
                    self._mode = _Mode.OBJECT
                elif body.startswith("{"):
                    self._head, self._pending = text[:len(text) - len(body)], body
                    self._mode = _Mode.OBJECT
                elif (not body or PYTHON_TAG.startswith(body)) and not final:
                    return
                else:
                    self._mode = _Mode.CONTENT
                continue
            if mode is _Mode.OBJECT:
                body = text.lstrip(WHITESPACE)
                self._head += text[:len(text) - len(body)]
                self._pending = body
                if body.startswith("{"):
                    self._call, self._mode = ObjectCall(self), _Mode.IN_CALL
                    continue
                if not body and not final:
                    return
                self._to_content("")
                continue
            if mode is _Mode.IN_CALL:
                assert self._call is not None
                used = self._call.feed(text)
                self._pending = text[used:]
                if self._call.status is CallStatus.RUNNING and final:
                    self._call.cut()
                if self._call.status is CallStatus.DONE:
                    self._head, self._mode = "", _Mode.BETWEEN
                    continue
                if self._call.status is CallStatus.REJECTED:
                    self._to_content(self._call.leftover)
                    continue
                return
            # BETWEEN: whitespace, then ";" and the next call, or content
            body = text.lstrip(WHITESPACE)
            self._head += text[:len(text) - len(body)]
            self._pending = body
            if body.startswith(SEPARATOR):
                self._head += SEPARATOR
                self._pending = body[len(SEPARATOR):]
                self._mode = _Mode.OBJECT
                continue
            if not body and not final:
                return
            self._to_content("")

    def _to_content(self, consumed: str) -> None:
        """No (further) call: the text since the last call is content, and so is the rest."""
        self.emit_content(self._head)
        self._pending = consumed + self._pending
        self._head, self._call, self._mode = "", None, _Mode.CONTENT


class Llama3JsonToolParser(ToolParserBase):
    """Llama 3.x JSON calls (``{"name": ..., "parameters": {...}}``, ``;``-separated)."""

    name = "llama3_json"
    needs_special_tokens = True

    @staticmethod
    def default_id_factory() -> IdFactory:
        return openai_tool_call_id

    def streaming(self) -> Llama3JsonStreamingParser:
        return Llama3JsonStreamingParser(self.id_factory)
