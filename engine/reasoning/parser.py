"""The reasoning-parser interface: a reply -> (reasoning, content); a stream of text deltas -> per delta
(reasoning piece, content piece), which reassemble to exactly the whole reply's split.

Where a reply starts (``ReasoningState``) depends on the rendered prompt: a chat template that ends the
prompt inside an open ``<think>`` (Qwen3 thinking templates, DeepSeek-R1's) makes the reply start in
reasoning without the opening tag; one that ends it with a closed ``<think></think>`` (Qwen3 with
``enable_thinking: false``) makes the whole reply content. Otherwise the format's default applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, NamedTuple, Optional, Protocol, Union


class ReasoningState(Enum):
    """Where the reply is."""

    BEFORE = "before"
    """Not started: an opening tag at the very start of the reply opens reasoning; anything else makes
    the whole reply content."""
    IN = "in"
    """In reasoning, up to the closing tag (an opening tag at the very start is dropped)."""
    AFTER = "after"
    """Reasoning is over (or never happens): everything is content."""


class ReasoningSplit(NamedTuple):
    """A whole reply, split."""

    reasoning_content: Optional[str]
    """The reasoning, tags removed; None when there is none."""
    content: Optional[str]
    """The rest; None when there is none."""


class ReasoningDelta(NamedTuple):
    """What one streamed text delta adds (both None: nothing yet, text held back)."""

    reasoning: Optional[str]
    """The next piece of ``reasoning_content``."""
    content: Optional[str]
    """The next piece of ``content``."""


@dataclass(frozen=True)
class ThinkTagIds:
    """The token ids of the tags (each tag one token in the model's vocabulary)."""

    start: int
    """``<think>``."""
    end: int
    """``</think>``."""

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int], start_tag: str, end_tag: str) -> ThinkTagIds:
        """The tags' ids from a tokenizer's ``get_vocab()``; ValueError when a tag is not one token."""
        missing = [tag for tag in (start_tag, end_tag) if tag not in vocab]
        if missing:
            raise ValueError(f"The tokenizer has no single token for {', '.join(missing)}; this reasoning "
                             "parser does not fit the model.")
        return cls(vocab[start_tag], vocab[end_tag])


class StreamingReasoningParser(Protocol):
    """The incremental parser of one reply."""

    @property
    def state(self) -> ReasoningState:
        """Where the text fed so far has left the reply."""
        ...

    @property
    def reasoning_ended(self) -> bool:
        """The reply is past its reasoning (state AFTER): a structured-output constraint applies from here."""
        ...

    def feed(self, delta: str) -> ReasoningDelta:
        """What ``delta`` completes (text that may be a tag is held back)."""
        ...

    def finish(self) -> ReasoningDelta:
        """The end of the reply: what was held back."""
        ...


class ReasoningParser(Protocol):
    """A ``--reasoning-parser`` format. Stateless: one per server; ``streaming()`` per reply."""

    name: ClassVar[str]
    """The ``--reasoning-parser`` value."""
    start_tag: ClassVar[str]
    end_tag: ClassVar[str]

    def initial_state(self, prompt: Optional[str] = None) -> ReasoningState:
        """Where a reply to ``prompt`` (the rendered prompt text; None: unknown) starts."""
        ...

    def extract(self, text: str, prompt: Optional[str] = None) -> ReasoningSplit:
        """A whole reply -> (reasoning_content, content)."""
        ...

    def streaming(self, prompt: Optional[str] = None) -> StreamingReasoningParser:
        """A fresh incremental parser for one reply to ``prompt``."""
        ...

    def reasoning_ended(self, output: Union[str, Sequence[int]], prompt: Optional[str] = None,
                        tag_ids: Optional[ThinkTagIds] = None) -> bool:
        """Whether ``output`` (text, or token ids with ``tag_ids``) is past its reasoning."""
        ...
