"""``--reasoning-parser deepseek_r1``: DeepSeek-R1's reasoning (vLLM's DeepSeekR1ReasoningParser semantics).

R1's template ends the prompt with ``<think>\\n`` (later revisions) or leaves the tag to the model, so
a reply starts in reasoning either way: everything before ``</think>`` is reasoning (a leading
``<think>`` dropped) and a reply without ``</think>`` is all reasoning. A prompt that ends with
``</think>`` (thinking turned off by the template) makes the reply content.
"""

from __future__ import annotations

from engine.reasoning.parser import ReasoningState
from engine.reasoning.think_tags import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1 and its distills: in reasoning from the reply's start until ``</think>``."""

    name = "deepseek_r1"
    default_state = ReasoningState.IN
