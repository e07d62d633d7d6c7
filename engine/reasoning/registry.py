"""``--reasoning-parser`` names -> parser classes."""

from __future__ import annotations

from engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.reasoning.qwen3 import Qwen3ReasoningParser
from engine.reasoning.think_tags import ThinkTagReasoningParser

REASONING_PARSERS: dict[str, type[ThinkTagReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
"""The values ``--reasoning-parser`` accepts."""


def get_reasoning_parser(name: str) -> ThinkTagReasoningParser:
    """The parser named ``name`` (one per server). ValueError listing the names for an unknown one."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}.")
    return cls()
