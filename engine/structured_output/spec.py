"""The canonical, hashable form of a constraint: what a backend compiles and the compile cache keys on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.structured_output.params import StructuredOutputsParams, parse_json_text


class GrammarKind(str, Enum):
    """The kinds of constraint, as ``StructuredOutputsParams`` names them."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    STRUCTURAL_TAG = "structural_tag"


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in canonical text: two requests with the same spec share one compiled grammar."""

    kind: GrammarKind
    """What ``text`` is."""
    text: str
    """JSON kinds and structural tags: compact JSON with the keys in their given order (property order
    is the generated order, so it is never sorted); ``choice``: the JSON list of the strings;
    ``regex`` / ``grammar``: as given; ``json_object``: empty."""
    any_whitespace: bool = True
    """JSON kinds: whitespace allowed between JSON tokens."""
    additional_properties: bool = True
    """JSON schema: False when the request asked for no properties beyond those listed."""

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> "GrammarSpec":
        kind = GrammarKind(params.kind)
        if kind is GrammarKind.JSON:
            schema = params.json
            if isinstance(schema, str):
                schema = parse_json_text(schema, "structured_outputs.json")
            text = canonical_json(schema)
        elif kind is GrammarKind.STRUCTURAL_TAG:
            tag = params.structural_tag
            if isinstance(tag, str):
                tag = parse_json_text(tag, "structured_outputs.structural_tag")
            text = canonical_json(tag)
        elif kind is GrammarKind.CHOICE:
            text = canonical_json(list(params.choice))
        elif kind is GrammarKind.JSON_OBJECT:
            text = ""
        else:
            text = getattr(params, kind.value)
        return cls(kind=kind, text=text, any_whitespace=not params.disable_any_whitespace,
                   additional_properties=not params.disable_additional_properties)

    def value(self) -> Any:
        """The parsed JSON of a JSON, choice or structural-tag spec."""
        return json.loads(self.text)

    def key(self) -> str:
        """A hex digest of everything that changes the compiled grammar (not the tokenizer or backend:
        the compile pool adds those)."""
        h = hashlib.sha256()
        for part in (self.kind.value, str(self.any_whitespace), str(self.additional_properties), self.text):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
        return h.hexdigest()

    def describe(self, max_chars: int = 64) -> str:
        """``kind`` and the start of ``text``, for logs and errors."""
        text = self.text
        if len(text) > max_chars:
            text = f"{text[:max_chars]}...<{len(text)} chars>"
        return f"{self.kind.value}: {text}" if text else self.kind.value


def canonical_json(value: Any) -> str:
    """Compact JSON of ``value``, keys in their order, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
