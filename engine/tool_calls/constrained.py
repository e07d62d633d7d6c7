"""The reply of a schema-constrained tool choice (``tool_choice`` ``required`` or a named function), read
as calls; the schemas themselves are built in ``engine.tool_calls.tool_choice``.

- ``required``: the reply is a JSON list of one or more calls (vLLM's format)::

      [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

  (``arguments`` is read as well as ``parameters``);
- a named function: the reply is that function's arguments object, ``{"city": "Paris"}``; the call is
  reported with the first character (a reply with no content, cut off in its reasoning, has no call).

The streamed form reports each call as soon as its name is read and its arguments as they are written,
like the free-text formats (``engine.tool_calls.parser``).
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from engine.tool_calls.ids import IdFactory, openai_tool_call_id
from engine.tool_calls.json_scan import WHITESPACE
from engine.tool_calls.object_call import CallArray, CallStatus
from engine.tool_calls.parser import StreamingToolParser, ToolParserBase


class _Mode(Enum):
    START = "before the list"
    IN_LIST = "in the list"
    CONTENT = "content"


class RequiredStreamingParser(StreamingToolParser):
    """A ``required`` reply: a JSON list of calls (text around it, if any, is content)."""

    def __init__(self, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._mode = _Mode.START
        self._list: Optional[CallArray] = None

    def _consume(self, final: bool) -> None:
        while True:
            text = self._pending
            if self._mode is _Mode.CONTENT:
                self.emit_content(text)
                self._pending = ""
                return
            if self._mode is _Mode.START:
                body = text.lstrip(WHITESPACE)
                if body.startswith("["):
                    self._list, self._mode = CallArray(self), _Mode.IN_LIST
                    continue
                if not body and not final:
                    return
                self._mode = _Mode.CONTENT
                continue
            assert self._list is not None
            used = self._list.feed(text)
            self._pending = text[used:]
            if self._list.status is CallStatus.RUNNING and final:
                self._list.cut()
            if self._list.status is CallStatus.RUNNING:
                return
            self._pending = self._list.leftover + self._pending
            self._mode = _Mode.CONTENT


class NamedStreamingParser(StreamingToolParser):
    """A named function's reply: all of it is the arguments of one call."""

    def __init__(self, id_factory: IdFactory, function_name: str) -> None:
        super().__init__(id_factory)
        self._function_name = function_name
        self._index: Optional[int] = None

    def _consume(self, final: bool) -> None:
        if self._index is None:
            if not self._pending:   # nothing written (a reply cut off in its reasoning): no call
                return
            self._index = self.start_call(self._function_name)
        self.emit_arguments(self._index, self._pending)
        self._pending = ""


class ConstrainedToolParser(ToolParserBase):
    """The calls of a ``required`` reply (``function_name`` None) or of a named function's reply."""

    name = "constrained"
    needs_special_tokens = False

    def __init__(self, function_name: Optional[str] = None, id_factory: Optional[IdFactory] = None) -> None:
        super().__init__(id_factory)
        self.function_name = function_name
        """The named function; None: ``required`` (a list of calls)."""

    @staticmethod
    def default_id_factory() -> IdFactory:
        return openai_tool_call_id

    def streaming(self) -> StreamingToolParser:
        if self.function_name is None:
            return RequiredStreamingParser(self.id_factory)
        return NamedStreamingParser(self.id_factory, self.function_name)
