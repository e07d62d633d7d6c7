"""Tool calls written as JSON: one object ``{"name": "f", "arguments": {...}}`` (``ObjectCall``) and a
list of them ``[{...}, {...}]`` (``CallArray``), read incrementally into a ``StreamingToolParser``.

An object is a call when its ``name`` is a non-empty string and no key other than ``CALL_KEYS`` comes
before the name. The call is reported when the name has been read; the arguments (the value of
``arguments`` or ``parameters``, whichever comes first) are reported verbatim as they arrive, those
written before the name right after it. A call without arguments gets ``{}``.

When an object turns out not to be a call, everything it consumed is handed back (``leftover``) for
the format to read again as content: a decision made at any point of the text gives the same result
whichever way the text was split into deltas.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Optional

from engine.tool_calls.json_scan import WHITESPACE, JsonObjectScanner, ObjectEvent
from engine.tool_calls.parser import StreamingToolParser

ARGUMENT_KEYS = ("arguments", "parameters")
"""Keys whose value is the call's arguments (Hermes / Mistral write ``arguments``, Llama ``parameters``)."""
CALL_KEYS = frozenset({"name", "type", "id", *ARGUMENT_KEYS})
"""Keys a call object may have before its name (later unknown keys are ignored)."""
NO_ARGUMENTS = "{}"


class CallStatus(Enum):
    RUNNING = "running"
    DONE = "done"
    """The call ended (reported), or the list ended."""
    REJECTED = "rejected"
    """Not a call: ``leftover`` is the text to read again as content."""


class ObjectCall:
    """One call written as a JSON object, read from its ``{`` (leading whitespace allowed)."""

    def __init__(self, sink: StreamingToolParser) -> None:
        self._sink = sink
        self._scanner = JsonObjectScanner()
        self.status = CallStatus.RUNNING
        """RUNNING until the object closes, breaks or is refused."""
        self._raw: list[str] = []
        """Everything consumed so far, in pieces (joined only when the object is refused)."""
        self.leftover = ""
        """When REJECTED: the consumed text, to be read again as content."""
        self.index: Optional[int] = None
        """The call's index once reported (its name read)."""
        self._name_raw = ""
        self._args_key: Optional[str] = None
        self._args_done = False
        self._args_before_name = ""
        self._args_reported = False

    @property
    def reported(self) -> bool:
        """The call has been reported: it stays a call whatever follows."""
        return self.index is not None

    def feed(self, text: str) -> int:
        """Read ``text`` until the object ends; returns the characters consumed."""
        used, events = self._scanner.feed(text)
        self._raw.append(text[:used])
        for event in events:
            self._on(event)
            if self.status is not CallStatus.RUNNING:
                break
        return used

    def cut(self) -> None:
        """The text of the object ends here (the reply ended, or a closing tag came first)."""
        if self.status is CallStatus.RUNNING:
            self._end() if self.reported else self._reject()

    def _on(self, event: ObjectEvent) -> None:
        if event.kind == "key":
            if not self.reported and event.key not in CALL_KEYS:
                self._reject()
            elif event.key in ARGUMENT_KEYS and self._args_key is None:
                self._args_key = event.key
        elif event.kind == "value":
            self._on_value(event)
        elif event.kind in ("close", "error"):
            self._end() if self.reported else self._reject()

    def _on_value(self, event: ObjectEvent) -> None:
        if event.key == "name" and not self.reported:
            if not self._name_raw and not event.text.startswith('"'):
                self._reject()
                return
            self._name_raw += event.text
            if event.ended:
                try:
                    name = json.loads(self._name_raw)
                except ValueError:
                    name = None
                if not isinstance(name, str) or not name.strip():
                    self._reject()
                    return
                self.index = self._sink.start_call(name)
                if self._args_before_name:
                    self._report_args(self._args_before_name)
        elif event.key == self._args_key and not self._args_done:
            if self.reported:
                self._report_args(event.text)
            else:
                self._args_before_name += event.text
            self._args_done = event.ended      # later argument keys are ignored

    def _report_args(self, text: str) -> None:
        assert self.index is not None
        if text:
            self._args_reported = True
            self._sink.emit_arguments(self.index, text)

    def _end(self) -> None:
        if not self._args_reported:
            self._report_args(NO_ARGUMENTS)
        self.status = CallStatus.DONE

    def _reject(self) -> None:
        self.status = CallStatus.REJECTED
        self.leftover = "".join(self._raw)


class _ArrayState(Enum):
    OPEN = "before ["
    OBJECT = "before an object"
    IN_CALL = "in an object"
    AFTER_CALL = "after an object"


class CallArray:
    """A JSON list of call objects ``[{...}, {...}]``, read from its ``[`` (leading whitespace allowed).

    A list whose first element is not a call is REJECTED (``leftover``: all of it). After a call, text
    that does not continue the list ends it (DONE); that text, from the last call's end, is ``leftover``."""

    def __init__(self, sink: StreamingToolParser) -> None:
        self._sink = sink
        self._state = _ArrayState.OPEN
        self._call: Optional[ObjectCall] = None
        self._num_calls = 0
        self.status = CallStatus.RUNNING
        self._raw: list[str] = []
        """Everything consumed so far, in pieces."""
        self.leftover = ""
        """When the list ended or was refused: consumed text to read again as content."""
        self._since_call: list[str] = []
        """Text consumed since the last call's end (separators, a refused element), in pieces."""

    def feed(self, text: str) -> int:
        """Read ``text`` until the list ends; returns the characters consumed."""
        i, n = 0, len(text)
        while i < n and self.status is CallStatus.RUNNING:
            st = self._state
            if st is _ArrayState.IN_CALL:
                assert self._call is not None
                used = self._call.feed(text[i:])
                self._consumed(text[i:i + used])
                i += used
                if self._call.status is CallStatus.DONE:
                    self._num_calls += 1
                    self._since_call = []
                    self._state = _ArrayState.AFTER_CALL
                elif self._call.status is CallStatus.REJECTED:
                    self._stop()
                continue
            c = text[i]
            if st is _ArrayState.OBJECT and c == "{":
                self._call = ObjectCall(self._sink)
                self._state = _ArrayState.IN_CALL
                continue
            self._consumed(c)
            i += 1
            if c in WHITESPACE:
                continue
            if (st is _ArrayState.OPEN and c == "[") or (st is _ArrayState.AFTER_CALL and c == ","):
                self._state = _ArrayState.OBJECT
            elif c == "]" and st is not _ArrayState.OPEN and self._num_calls:
                self._since_call = []
                self.status = CallStatus.DONE
            else:
                self._stop()
        return i

    def cut(self) -> None:
        """The text ends here."""
        if self.status is not CallStatus.RUNNING:
            return
        if self._state is _ArrayState.IN_CALL and self._call is not None:
            self._call.cut()
            if self._call.status is CallStatus.DONE:
                self._num_calls += 1
                self._since_call = []
        self._stop()

    def _consumed(self, text: str) -> None:
        self._raw.append(text)
        self._since_call.append(text)

    def _stop(self) -> None:
        if self._num_calls:
            self.status, self.leftover = CallStatus.DONE, "".join(self._since_call)
        else:
            self.status, self.leftover = CallStatus.REJECTED, "".join(self._raw)
