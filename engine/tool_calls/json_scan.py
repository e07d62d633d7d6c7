"""Incremental scanning of JSON text fed in pieces of any size: where one value ends (``JsonValueScanner``)
and the keys and raw values of one object (``JsonObjectScanner``), each character read once.

The scanners find structure, they do not validate: brackets are counted without matching their kinds,
and scalars are read up to the next delimiter. ``json.loads`` of what they delimit is the caller's check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Optional

WHITESPACE = " \t\n\r"
_SCALAR_START = frozenset("-0123456789tfn")
"""First characters of numbers, true, false and null."""
_SCALAR_END = frozenset(WHITESPACE + ",}]")


class JsonValueScanner:
    """Finds the end of one JSON value that starts at the first character fed (not whitespace)."""

    def __init__(self) -> None:
        self.started = False
        """The first character has been read."""
        self.ended = False
        """The value is complete."""
        self._scalar = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @staticmethod
    def can_start(c: str) -> bool:
        """``c`` may begin a JSON value."""
        return c in "{[\"" or c in _SCALAR_START

    def feed(self, text: str, start: int = 0) -> int:
        """Read ``text[start:]`` up to the value's end; returns how many characters belong to the value.
        A scalar ends before its delimiter (not counted); a string, object or array at its last
        character. The first character must satisfy ``can_start``."""
        i, n = start, len(text)
        if not self.started and i < n:
            self.started = True
            c = text[i]
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth = 1
            else:
                self._scalar = True
            i += 1
        if self._scalar:
            while i < n and text[i] not in _SCALAR_END:
                i += 1
            if i < n:
                self.ended = True
            return i - start
        while i < n:
            c = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.ended = True
                        break
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.ended = True
                    break
        return i - start

    def end_of_input(self) -> None:
        """The text ends here: a scalar being read is complete."""
        if self._scalar and self.started:
            self.ended = True


class _State(Enum):
    OPEN = "before {"
    KEY_OR_CLOSE = "after {"
    KEY = "after ,"
    IN_KEY = "in a key"
    COLON = "before :"
    VALUE = "before a value"
    IN_VALUE = "in a value"
    COMMA_OR_CLOSE = "after a value"
    DONE = "closed"
    FAILED = "not an object"


@dataclass
class ObjectEvent:
    """What a piece of an object's text completed."""

    kind: str
    """``key`` (a key was read: ``key``), ``value`` (``text``: more characters of ``key``'s value;
    ``ended``: the value is complete), ``close`` (the object closed), ``error`` (not JSON here)."""
    key: Optional[str] = None
    """The key (``key`` and ``value`` events)."""
    text: str = ""
    """The value's next raw characters (``value`` events)."""
    ended: bool = False
    """The value is complete (``value`` events)."""


class JsonObjectScanner:
    """Reads one JSON object (leading whitespace allowed) and reports its keys and its values' raw text as
    they arrive. Stops at the object's closing brace or at the first character that breaks the syntax."""

    def __init__(self) -> None:
        self._state = _State.OPEN
        self._key_raw = ""
        self._key_scanner: Optional[JsonValueScanner] = None
        self._key: Optional[str] = None
        self._value: Optional[JsonValueScanner] = None

    @property
    def done(self) -> bool:
        """The object closed."""
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        """A character broke the syntax (it was consumed)."""
        return self._state is _State.FAILED

    def feed(self, text: str) -> tuple[int, list[ObjectEvent]]:
        """Read ``text`` until the object closes or fails; returns (characters consumed, events)."""
        events: list[ObjectEvent] = []
        i, n = 0, len(text)
        while i < n and self._state not in (_State.DONE, _State.FAILED):
            st, c = self._state, text[i]
            if st is _State.IN_VALUE:
                assert self._value is not None
                used = self._value.feed(text, i)
                events.append(ObjectEvent("value", self._key, text[i:i + used], self._value.ended))
                i += used
                if self._value.ended:
                    self._state = _State.COMMA_OR_CLOSE
                continue
            if st is _State.IN_KEY:
                assert self._key_scanner is not None
                used = self._key_scanner.feed(text, i)
                self._key_raw += text[i:i + used]
                i += used
                if self._key_scanner.ended:
                    try:
                        self._key = json.loads(self._key_raw)
                    except ValueError:
                        self._state = _State.FAILED
                        events.append(ObjectEvent("error"))
                        continue
                    events.append(ObjectEvent("key", self._key))
                    self._state = _State.COLON
                continue
            i += 1
            if c in WHITESPACE and st is not _State.VALUE:
                continue
            if st is _State.OPEN:
                self._state = _State.KEY_OR_CLOSE if c == "{" else _State.FAILED
            elif st in (_State.KEY_OR_CLOSE, _State.KEY):
                if c == '"':
                    self._key_scanner = JsonValueScanner()
                    self._key_raw = ""
                    self._state = _State.IN_KEY
                    i -= 1            # the scanner reads the opening quote
                elif c == "}" and st is _State.KEY_OR_CLOSE:
                    self._state = _State.DONE
                    events.append(ObjectEvent("close"))
                else:
                    self._state = _State.FAILED
            elif st is _State.COLON:
                self._state = _State.VALUE if c == ":" else _State.FAILED
            elif st is _State.VALUE:
                if c in WHITESPACE:
                    continue
                if JsonValueScanner.can_start(c):
                    self._value = JsonValueScanner()
                    self._state = _State.IN_VALUE
                    i -= 1
                else:
                    self._state = _State.FAILED
            elif st is _State.COMMA_OR_CLOSE:
                if c == ",":
                    self._state = _State.KEY
                elif c == "}":
                    self._state = _State.DONE
                    events.append(ObjectEvent("close"))
                else:
                    self._state = _State.FAILED
            if self._state is _State.FAILED:
                events.append(ObjectEvent("error"))
        return i, events
