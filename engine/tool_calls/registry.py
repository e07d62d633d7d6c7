"""``--tool-call-parser`` names -> parser classes."""

from __future__ import annotations

from typing import Optional

from engine.tool_calls.hermes import HermesToolParser
from engine.tool_calls.ids import IdFactory
from engine.tool_calls.llama3_json import Llama3JsonToolParser
from engine.tool_calls.mistral import MistralToolParser
from engine.tool_calls.parser import ToolParserBase

TOOL_PARSERS: dict[str, type[ToolParserBase]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    MistralToolParser.name: MistralToolParser,
}
"""The values ``--tool-call-parser`` accepts."""


def get_tool_parser(name: str, id_factory: Optional[IdFactory] = None) -> ToolParserBase:
    """The parser named ``name`` (one per server). ValueError listing the names for an unknown one."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"Unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}.")
    return cls(id_factory)
