"""The engine side of ``--reasoning-parser``: each constrained request gets a ``ReasoningTokenTracker``, so
its grammar constrains only what follows the reasoning (vLLM's reasoner in structured outputs).

Where the reply starts (in reasoning, before it, after it) is read off the end of the prompt, as the
server's text parser reads it off the rendered prompt: a prompt ending with an open ``<think>`` starts in
reasoning, one ending with ``</think>`` starts in content, any other the format's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.reasoning.parser import ThinkTagIds
from engine.reasoning.think_tags import ReasoningTokenTracker, ThinkTagReasoningParser

PROMPT_TAIL_TOKENS = 8
"""Prompt tokens decoded to find where the reply starts (a tag and the whitespace after it fit)."""


class ReasoningGate:
    """Builds one tracker per constrained request; the tags must be single tokens of the tokenizer."""

    def __init__(self, parser: ThinkTagReasoningParser, tokenizer: Any) -> None:
        self.parser = parser
        """The --reasoning-parser format."""
        self.tokenizer = tokenizer
        """The model's tokenizer (decodes the prompt's tail)."""
        self.tag_ids: ThinkTagIds = parser.tag_ids(tokenizer.get_vocab())
        """The tags' token ids; ValueError at construction when the tokenizer has no single token for one."""

    def tracker(self, prompt_token_ids: Sequence[int]) -> ReasoningTokenTracker:
        """The tracker of a reply to ``prompt_token_ids``."""
        tail = self.tokenizer.decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return ReasoningTokenTracker(self.tag_ids, self.parser.initial_state(tail))
