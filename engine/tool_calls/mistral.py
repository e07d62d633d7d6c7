"""``--tool-call-parser mistral``: Mistral's calls after the ``[TOOL_CALLS]`` token, in either form::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}

The list form (older tokenizers) holds parallel calls in one list; the ``name[ARGS]`` form (tokenizer
v11 and later) repeats ``[TOOL_CALLS]`` per call. ``[TOOL_CALLS]{...}`` (a single object) is read as
one call. Text outside calls is content; a ``[TOOL_CALLS]`` that leads to no call is content, verbatim.
A name is letters, digits, ``_``, ``-`` and ``.``; arguments after ``[ARGS]`` must be a JSON object.
Ids are Mistral's 9 characters (its templates refuse others). ``[TOOL_CALLS]`` and ``[ARGS]`` are
special tokens: requests are detokenized with ``skip_special_tokens=False``.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Optional, Union

from engine.tool_calls.ids import IdFactory, mistral_tool_call_id
from engine.tool_calls.json_scan import WHITESPACE, JsonValueScanner
from engine.tool_calls.object_call import CallArray, CallStatus, ObjectCall
from engine.tool_calls.parser import StreamingToolParser, ToolParserBase, partial_tag_length

CALLS_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
"""The characters of a function name in the ``name[ARGS]`` form."""


class _Mode(Enum):
    CONTENT = "content"
    AFTER_TAG = "after [TOOL_CALLS]"
    IN_JSON = "in a list of calls or one call object"
    NAME = "in a name"
    BEFORE_ARGS = "after [ARGS], before the arguments"
    IN_ARGS = "in the arguments of name[ARGS]"


class MistralStreamingParser(StreamingToolParser):
    """One reply in Mistral's format (see the module doc)."""

    def __init__(self, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._mode = _Mode.CONTENT
        self._head = ""
        """Text consumed since ``[TOOL_CALLS]`` (included) that is content if no call follows."""
        self._json: Optional[Union[CallArray, ObjectCall]] = None
        self._name = ""
        self._args: Optional[JsonValueScanner] = None
        self._index = -1

    def _consume(self, final: bool) -> None:
        while True:
            mode, text = self._mode, self._pending
            if mode is _Mode.CONTENT:
                at = text.find(CALLS_TAG)
                if at >= 0:
                    self.emit_content(text[:at])
                    self._pending = text[at + len(CALLS_TAG):]
                    self._head, self._mode = CALLS_TAG, _Mode.AFTER_TAG
                    continue
                keep = 0 if final else partial_tag_length(text, CALLS_TAG)
                self.emit_content(text[:len(text) - keep])
                self._pending = text[len(text) - keep:]
                return
            if mode is _Mode.AFTER_TAG:
                body = text.lstrip(WHITESPACE)
                self._head += text[:len(text) - len(body)]
                self._pending = body
                if body.startswith("["):
                    self._json, self._mode = CallArray(self), _Mode.IN_JSON
                elif body.startswith("{"):
                    self._json, self._mode = ObjectCall(self), _Mode.IN_JSON
                elif body:
                    self._name, self._mode = "", _Mode.NAME
                elif final:
                    self._no_call("")
                else:
                    return
                continue
            if mode is _Mode.IN_JSON:
                assert self._json is not None
                used = self._json.feed(text)
                self._pending = text[used:]
                if self._json.status is CallStatus.RUNNING and final:
                    self._json.cut()
                if self._json.status is CallStatus.REJECTED:
                    self._no_call(self._json.leftover)
                elif self._json.status is CallStatus.DONE:
                    leftover = self._json.leftover if isinstance(self._json, CallArray) else ""
                    self._pending = leftover + self._pending
                    self._head, self._json, self._mode = "", None, _Mode.CONTENT
                else:
                    return
                continue
            if mode is _Mode.NAME:
                name = _NAME.match(text)
                assert name is not None
                self._name += name.group()
                self._head += name.group()
                rest = text[name.end():]
                self._pending = rest
                if rest.startswith(ARGS_TAG) and self._name:
                    self._head += ARGS_TAG
                    self._pending = rest[len(ARGS_TAG):]
                    self._mode = _Mode.BEFORE_ARGS
                elif final or (rest and not (self._name and ARGS_TAG.startswith(rest))):
                    self._no_call("")
                else:
                    return
                continue
            if mode is _Mode.BEFORE_ARGS:
                body = text.lstrip(WHITESPACE)
                self._head += text[:len(text) - len(body)]
                self._pending = body
                if body.startswith("{"):
                    self._index = self.start_call(self._name)
                    self._args, self._mode = JsonValueScanner(), _Mode.IN_ARGS
                elif body or final:
                    self._no_call("")
                else:
                    return
                continue
            # IN_ARGS
            assert self._args is not None
            used = self._args.feed(text)
            self.emit_arguments(self._index, text[:used])
            self._pending = text[used:]
            if self._args.ended or final:
                self._head, self._args, self._mode = "", None, _Mode.CONTENT
                continue
            return

    def _no_call(self, consumed: str) -> None:
        """What followed ``[TOOL_CALLS]`` is no call: the tag and that text are content."""
        self.emit_content(self._head)
        self._pending = consumed + self._pending
        self._head, self._json, self._mode = "", None, _Mode.CONTENT


class MistralToolParser(ToolParserBase):
    """``[TOOL_CALLS][{...}, ...]`` and ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral, Mixtral, Ministral)."""

    name = "mistral"
    needs_special_tokens = True

    @staticmethod
    def default_id_factory() -> IdFactory:
        return mistral_tool_call_id

    def streaming(self) -> MistralStreamingParser:
        return MistralStreamingParser(self.id_factory)
