"""``--reasoning-parser qwen3``: Qwen3's ``<think>...</think>`` (vLLM's Qwen3ReasoningParser semantics).

Qwen3 writes ``<think>`` itself when the template leaves the prompt at ``<|im_start|>assistant\\n``; the
thinking templates (Qwen3-*-Thinking, QwQ-style) end the prompt with ``<think>\\n`` so the reply starts in
reasoning without the tag; ``enable_thinking: false`` ends the prompt with ``<think>\\n\\n</think>\\n\\n``
so the reply is content. ``initial_state`` reads which from the rendered prompt. With no prompt
information the reply must open with ``<think>`` to have reasoning: a reply without it is all content.
"""

from __future__ import annotations

from engine.reasoning.parser import ReasoningState
from engine.reasoning.think_tags import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3 (and QwQ): reasoning only after an opening ``<think>`` (in the reply or at the prompt's end)."""

    name = "qwen3"
    default_state = ReasoningState.BEFORE
