"""The think-tag state machine (``<think>`` ... ``</think>``) over text deltas and over token ids.

Rules (``ReasoningState`` names the states):

- BEFORE: the reply starts with the opening tag (no whitespace before it) -> the tag is dropped and
  reasoning begins; any other start -> the whole reply is content (a later tag is text);
- IN: everything up to the closing tag is reasoning; the closing tag is dropped and the rest is content.
  An opening tag at the very start of the reply is dropped (models that write it although the prompt
  opened reasoning); no closing tag -> all of the reply is reasoning (cut short, or still thinking);
- AFTER: everything is content.

The same rules over token ids (``ReasoningTokenTracker``) tell the structured-output integration where
reasoning ends: each tag is one token, and in BEFORE the first token decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Optional, Union

from engine.reasoning.parser import ReasoningDelta, ReasoningSplit, ReasoningState, ThinkTagIds

WHITESPACE = " \t\n\r"


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkTagStreamingParser:
    """One reply: ``feed`` each text delta, then ``finish`` once."""

    def __init__(self, start_tag: str, end_tag: str, state: ReasoningState) -> None:
        self._start_tag, self._end_tag = start_tag, end_tag
        self._state = state
        self._at_start = True
        """Nothing of the reply has been decided yet (an opening tag here is dropped)."""
        self._pending = ""

    @property
    def state(self) -> ReasoningState:
        return self._state

    @property
    def reasoning_ended(self) -> bool:
        return self._state is ReasoningState.AFTER

    def feed(self, delta: str) -> ReasoningDelta:
        self._pending += delta
        return self._consume(final=False)

    def finish(self) -> ReasoningDelta:
        return self._consume(final=True)

    def _consume(self, final: bool) -> ReasoningDelta:
        reasoning, content = "", ""
        while True:
            text = self._pending
            if self._at_start and self._state is not ReasoningState.AFTER:
                if text.startswith(self._start_tag):
                    self._pending = text[len(self._start_tag):]
                    self._state = ReasoningState.IN
                elif (not text or self._start_tag.startswith(text)) and not final:
                    break
                elif self._state is ReasoningState.BEFORE:
                    self._state = ReasoningState.AFTER
                self._at_start = False
                continue
            if self._state is ReasoningState.IN:
                at = text.find(self._end_tag)
                if at >= 0:
                    reasoning += text[:at]
                    self._pending = text[at + len(self._end_tag):]
                    self._state = ReasoningState.AFTER
                    continue
                keep = 0 if final else _partial_tag_length(text, self._end_tag)
                reasoning += text[:len(text) - keep]
                self._pending = text[len(text) - keep:]
                break
            content += text
            self._pending = ""
            break
        return ReasoningDelta(reasoning or None, content or None)


class ReasoningTokenTracker:
    """The think-tag rules over token ids, for the structured-output integration: ``feed`` the sampled
    ids; the constraint applies once ``reasoning_ended``. In BEFORE the first token decides: allow
    ``tag_ids.start`` there besides what the grammar allows."""

    def __init__(self, tag_ids: ThinkTagIds, state: ReasoningState) -> None:
        self.tag_ids = tag_ids
        """The tags' token ids."""
        self.state = state
        """Where the ids fed so far have left the reply."""
        self._at_start = True

    @property
    def reasoning_ended(self) -> bool:
        return self.state is ReasoningState.AFTER

    def feed(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; returns ``reasoning_ended``."""
        for token_id in token_ids:
            if self.state is ReasoningState.AFTER:
                break
            if self._at_start:
                self._at_start = False
                if token_id == self.tag_ids.start:
                    self.state = ReasoningState.IN
                    continue
                if self.state is ReasoningState.BEFORE:
                    self.state = ReasoningState.AFTER
                    break
            if token_id == self.tag_ids.end:
                self.state = ReasoningState.AFTER
        return self.reasoning_ended


class ThinkTagReasoningParser:
    """A ``ReasoningParser`` over think tags; subclasses set the name and the default start state."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    default_state: ClassVar[ReasoningState] = ReasoningState.IN
    """Where a reply starts when the prompt does not say."""

    def initial_state(self, prompt: Optional[str] = None) -> ReasoningState:
        """IN when the prompt ends with an open ``<think>`` (whitespace after it allowed), AFTER when it ends
        with ``</think>``, else ``default_state``."""
        tail = (prompt or "").rstrip(WHITESPACE)
        if tail.endswith(self.start_tag):
            return ReasoningState.IN
        if tail.endswith(self.end_tag):
            return ReasoningState.AFTER
        return self.default_state

    def streaming(self, prompt: Optional[str] = None) -> ThinkTagStreamingParser:
        return ThinkTagStreamingParser(self.start_tag, self.end_tag, self.initial_state(prompt))

    def extract(self, text: str, prompt: Optional[str] = None) -> ReasoningSplit:
        parser = self.streaming(prompt)
        first, last = parser.feed(text), parser.finish()
        reasoning = (first.reasoning or "") + (last.reasoning or "")
        content = (first.content or "") + (last.content or "")
        return ReasoningSplit(reasoning or None, content or None)

    def tag_ids(self, vocab: dict[str, int]) -> ThinkTagIds:
        """The tags' token ids in a tokenizer's vocabulary (``get_vocab()``)."""
        return ThinkTagIds.from_vocab(vocab, self.start_tag, self.end_tag)

    def reasoning_ended(self, output: Union[str, Sequence[int]], prompt: Optional[str] = None,
                        tag_ids: Optional[ThinkTagIds] = None) -> bool:
        if isinstance(output, str):
            parser = self.streaming(prompt)
            parser.feed(output)
            return parser.reasoning_ended
        if tag_ids is None:
            raise ValueError("reasoning_ended over token ids needs the tags' ids (tag_ids).")
        return ReasoningTokenTracker(tag_ids, self.initial_state(prompt)).feed(output)
