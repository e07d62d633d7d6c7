"""The tool-call parser interface: a whole reply -> ``ExtractedToolCalls``; a stream of text deltas ->
``StreamPiece``s (content and OpenAI-shaped ``DeltaToolCall``s).

Every format is one incremental state machine (a ``StreamingToolParser`` subclass); ``extract`` feeds it
the whole text at once. The streamed pieces of any split of a text into deltas therefore reassemble
(``assemble``) to exactly what ``extract`` returns for it: the same content, the same calls, each call's
``arguments`` the concatenation of its argument deltas.

Rules shared by the formats:

- a call is reported (its first delta: ``index``, ``id``, ``type: "function"``, ``function.name`` and
  ``function.arguments: ""``) as soon as its name has been read; its arguments follow as they are
  written, verbatim (the JSON text the model wrote, not re-serialized);
- text outside calls is content; content that is only whitespace is no content (``None``): whitespace
  is held back until the content is known to hold something else;
- text that only looks like the start of a call (a tag, a JSON object without a string ``name``, an
  unknown key before the name) is content, verbatim. A call whose name was reported stays a call, also
  when the text is cut short (``finish_reason: "length"``): its arguments are then what was written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Protocol

from engine.tool_calls.ids import IdFactory


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call of a reply."""

    id: str
    """``call_...`` (OpenAI's form) or a 9-character Mistral id."""
    name: str
    """The function's name, as the model wrote it."""
    arguments_json: str
    """The arguments, JSON text (an object for well-formed calls)."""

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class ExtractedToolCalls:
    """A reply split into content and tool calls."""

    content: Optional[str]
    """The text outside the calls; None when there is none (or only whitespace)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The calls in the order written (parallel calls when more than one)."""

    @property
    def tools_called(self) -> bool:
        """The reply has calls: its ``finish_reason`` is ``"tool_calls"`` (unless cut by ``length``)."""
        return bool(self.tool_calls)


@dataclass
class DeltaFunction:
    """``function`` of a streamed tool-call delta."""

    name: Optional[str] = None
    """Set in the call's first delta only."""
    arguments: Optional[str] = None
    """The next piece of the arguments' JSON text (``""`` in the first delta)."""


@dataclass
class DeltaToolCall:
    """One entry of OpenAI's ``delta.tool_calls``."""

    index: int
    """The call's position in the reply (0, 1, ...): the key that joins its deltas."""
    function: DeltaFunction
    """Name (first delta) and the next piece of the arguments."""
    id: Optional[str] = None
    """Set in the call's first delta only."""
    type: Optional[Literal["function"]] = None
    """``"function"`` in the call's first delta only."""

    def to_openai(self) -> dict[str, Any]:
        """The delta entry as OpenAI sends it (fields that are None left out)."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        function: dict[str, str] = {}
        if self.function.name is not None:
            function["name"] = self.function.name
        if self.function.arguments is not None:
            function["arguments"] = self.function.arguments
        out["function"] = function
        return out


@dataclass
class StreamPiece:
    """One piece of a streamed reply, in order: content or a tool-call delta (exactly one is set)."""

    content: Optional[str] = None
    """Text outside calls."""
    tool_call: Optional[DeltaToolCall] = None
    """A tool-call delta."""


def assemble(pieces: list[StreamPiece]) -> ExtractedToolCalls:
    """What streamed pieces add up to: content concatenated, each call's argument deltas concatenated."""
    content = "".join(p.content for p in pieces if p.content is not None)
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        if p.tool_call is None:
            continue
        d = p.tool_call
        call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id is not None:
            call["id"] = d.id
        if d.function.name is not None:
            call["name"] = d.function.name
        call["arguments"] += d.function.arguments or ""
    return ExtractedToolCalls(content=content if content.strip() else None,
                              tool_calls=[ToolCall(c["id"], c["name"], c["arguments"])
                                          for _, c in sorted(calls.items())])


def to_openai_deltas(pieces: list[StreamPiece]) -> list[dict[str, Any]]:
    """Pieces -> OpenAI ``delta`` dicts, in order: ``{"content": str}`` for a run of content pieces,
    ``{"tool_calls": [...]}`` for a run of tool-call pieces (one chunk each)."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if p.content is not None:
            if out and "content" in out[-1]:
                out[-1]["content"] += p.content
            else:
                out.append({"content": p.content})
        elif p.tool_call is not None:
            if out and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(p.tool_call.to_openai())
            else:
                out.append({"tool_calls": [p.tool_call.to_openai()]})
    return out


WHITESPACE = " \t\n\r"
"""JSON's whitespace (and what counts as blank content)."""


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (text to hold back
    until the next delta tells whether it is the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StreamingToolParser(ABC):
    """The incremental parser of one reply: ``feed`` each text delta, then ``finish`` once.

    Subclasses implement ``_consume``: read ``self._pending`` (text received and not yet decided) as far
    as it can be decided, and report through ``emit_content``, ``start_call`` and ``emit_arguments``."""

    def __init__(self, id_factory: IdFactory) -> None:
        self._id_factory = id_factory
        self._pending = ""
        """Text received whose meaning is not decided yet (a possible tag, a call not named yet)."""
        self._out: list[StreamPiece] = []
        self._held_space = ""
        """Content whitespace held until the content is known to be more than whitespace."""
        self._content_seen = False
        self._num_calls = 0
        self._finished = False

    @property
    def tools_called(self) -> bool:
        """A call has been reported."""
        return self._num_calls > 0

    def feed(self, delta: str) -> list[StreamPiece]:
        """The pieces ``delta`` completes (possibly none: text that may be a tag is held back)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += delta
        self._consume(final=False)
        return self._take()

    def finish(self) -> list[StreamPiece]:
        """The end of the reply: what was held back, decided."""
        if self._finished:
            return []
        self._consume(final=True)
        self._finished = True
        return self._take()

    @abstractmethod
    def _consume(self, final: bool) -> None:
        """Decide as much of ``self._pending`` as possible (all of it when ``final``)."""

    # -- reporting (the format machines and the call readers of ``object_call``) -----------------------
    def emit_content(self, text: str) -> None:
        """Report content (whitespace is held until the content has something else)."""
        if not text:
            return
        if not self._content_seen:
            text = self._held_space + text
            if not text.strip(WHITESPACE):
                self._held_space = text
                return
            self._held_space = ""
            self._content_seen = True
        if self._out and self._out[-1].content is not None:
            self._out[-1].content += text
        else:
            self._out.append(StreamPiece(content=text))

    def start_call(self, name: str) -> int:
        """Report a new call named ``name``; returns its index."""
        index = self._num_calls
        self._num_calls += 1
        self._out.append(StreamPiece(tool_call=DeltaToolCall(
            index=index, id=self._id_factory(), type="function",
            function=DeltaFunction(name=name, arguments=""))))
        return index

    def emit_arguments(self, index: int, text: str) -> None:
        """Report the next piece of call ``index``'s arguments."""
        if not text:
            return
        last = self._out[-1].tool_call if self._out else None
        if last is not None and last.index == index:
            last.function.arguments = (last.function.arguments or "") + text
        else:
            self._out.append(StreamPiece(tool_call=DeltaToolCall(index=index,
                                                                 function=DeltaFunction(arguments=text))))

    def _take(self) -> list[StreamPiece]:
        out, self._out = self._out, []
        return out


class ToolParser(Protocol):
    """A ``--tool-call-parser`` format. Stateless: one per server; ``streaming()`` per reply."""

    name: ClassVar[str]
    """The ``--tool-call-parser`` value."""
    needs_special_tokens: ClassVar[bool]
    """Its tags are special tokens: the reply must be detokenized with ``skip_special_tokens=False``."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole reply -> content and calls."""
        ...

    def streaming(self) -> StreamingToolParser:
        """A fresh incremental parser for one streamed reply."""
        ...


class ToolParserBase(ABC):
    """``ToolParser`` over a ``StreamingToolParser``: ``extract`` is the stream of one delta."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, id_factory: Optional[IdFactory] = None) -> None:
        self.id_factory: IdFactory = id_factory or self.default_id_factory()
        """Makes each new call's id."""

    @staticmethod
    @abstractmethod
    def default_id_factory() -> IdFactory:
        """The ids this format's chat templates accept."""

    @abstractmethod
    def streaming(self) -> StreamingToolParser:
        """A fresh incremental parser for one streamed reply."""

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = self.streaming()
        return assemble(parser.feed(text) + parser.finish())
