"""A request's constraint on its output, in vLLM's shape (``SamplingParams(structured_outputs=...)`` and
the server's ``structured_outputs`` field), and OpenAI's ``response_format`` read into it.

Light on purpose: ``engine.sampling_params`` imports it, so it needs neither torch nor a grammar library.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

from engine.structured_output.errors import (PARAM_RESPONSE_FORMAT, PARAM_STRUCTURED_OUTPUTS,
                                             StructuredOutputError)

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The kinds of constraint; a request sets exactly one."""
_REPR_CHARS = 64
"""Characters of the constraint text ``repr`` shows before a count of the rest."""


def _bad(message: str, param: str = PARAM_STRUCTURED_OUTPUTS) -> StructuredOutputError:
    return StructuredOutputError(message, param=param)


def parse_json_text(value: str, what: str, param: str = PARAM_STRUCTURED_OUTPUTS) -> Any:
    """``value`` parsed as JSON; a ``StructuredOutputError`` naming ``what`` when it is not JSON."""
    try:
        return _json.loads(value)
    except ValueError as e:
        raise _bad(f"{what} is not valid JSON: {e}.", param) from None


@dataclass
class StructuredOutputsParams:
    """What the output must match: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object`` (True), ``structural_tag``. Invalid combinations and types raise
    ``StructuredOutputError`` (a ``ValueError``) at construction; whether the schema, regex or grammar
    compiles is the compiler's call (``engine.structured_output.compiler``)."""

    json: Optional[Union[dict, str, bool]] = None
    """A JSON schema (a dict, a boolean schema, or its JSON text): the output is one JSON value it
    validates."""
    regex: Optional[str] = None
    """A regular expression the whole output matches."""
    choice: Optional[list[str]] = None
    """The output is exactly one of these strings."""
    grammar: Optional[str] = None
    """A context-free grammar: GBNF/EBNF with a ``root`` rule (xgrammar), or Lark with a ``start`` rule
    (the guidance backend; ``auto`` falls back to it for Lark)."""
    json_object: Optional[bool] = None
    """True: the output is any JSON object (OpenAI's ``{"type": "json_object"}``)."""
    structural_tag: Optional[Union[str, dict]] = None
    """An xgrammar structural tag (JSON text or dict): ``{"type": "structural_tag", "format": ...}``, or
    the ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` form (both backends)."""
    disable_any_whitespace: bool = False
    """JSON kinds: no whitespace between tokens of the JSON (compact output); default: any whitespace."""
    disable_additional_properties: bool = False
    """JSON schema kind: objects get no properties beyond those the schema lists, wherever the schema
    does not say (xgrammar always behaves so; the guidance backend follows JSON Schema otherwise)."""
    _param: str = field(default=PARAM_STRUCTURED_OUTPUTS, compare=False)
    """The request field the constraint came from, which its errors blame (``structured_outputs`` or
    ``response_format``); set by ``from_dict`` / ``from_response_format``."""

    def __post_init__(self) -> None:
        chosen = self.kinds_set()
        if not chosen:
            raise _bad(f"structured_outputs must set one of {', '.join(KINDS)}.")
        if len(chosen) > 1:
            raise _bad(f"structured_outputs sets {' and '.join(chosen)}; exactly one kind of constraint "
                       f"is allowed.")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                schema = parse_json_text(schema, "structured_outputs.json")
            if not isinstance(schema, (dict, bool)):
                raise _bad(f"structured_outputs.json must be a JSON schema (an object or a boolean, or its "
                           f"JSON text), got {type(schema).__name__}.")
        if self.regex is not None and not isinstance(self.regex, str):
            raise _bad(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}.")
        if self.choice is not None:
            if isinstance(self.choice, (tuple, set)):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice:
                raise _bad("structured_outputs.choice must be a non-empty list of strings.")
            if any(not isinstance(c, str) for c in self.choice):
                raise _bad("structured_outputs.choice must contain only strings.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise _bad("structured_outputs.grammar must be a non-empty string.")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _bad(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}.")
        if self.structural_tag is not None:
            tag = self.structural_tag
            if isinstance(tag, str):
                tag = parse_json_text(tag, "structured_outputs.structural_tag")
            if not isinstance(tag, dict):
                raise _bad("structured_outputs.structural_tag must be a JSON object (or its JSON text).")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"structured_outputs.{name} must be a boolean, got {getattr(self, name)!r}.")

    def kinds_set(self) -> list[str]:
        """The kinds this constraint sets (one, once constructed)."""
        return [k for k in KINDS if (bool(getattr(self, k)) if k == "json_object"
                                     else getattr(self, k) is not None)]

    @property
    def param(self) -> str:
        """The request field this constraint's errors blame."""
        return self._param

    @property
    def kind(self) -> str:
        """The one kind set: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
        ``structural_tag``."""
        return self.kinds_set()[0]

    @classmethod
    def from_dict(cls, value: Mapping[str, Any], param: str = PARAM_STRUCTURED_OUTPUTS
                  ) -> "StructuredOutputsParams":
        """Build from a request body's ``structured_outputs`` object; unknown fields are an error."""
        if not isinstance(value, Mapping):
            raise _bad(f"{param} must be an object, got {type(value).__name__}.", param)
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise _bad(f"{param} has unsupported field(s) {', '.join(unknown)}; known: "
                       f"{', '.join(sorted(known))}.", param)
        try:
            return cls(**value, _param=param)
        except StructuredOutputError as e:
            raise e.with_param(param) from None

    @classmethod
    def from_response_format(cls, response_format: Any) -> Optional["StructuredOutputsParams"]:
        """Read OpenAI's ``response_format`` (a dict or a pydantic model): ``{"type": "text"}`` (or None)
        -> None; ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name",
        "schema", "strict"}}``; ``{"type": "structural_tag", ...}`` (the rest of the object is the
        tag). Errors blame ``response_format``."""
        if response_format is None:
            return None
        if hasattr(response_format, "model_dump"):
            response_format = response_format.model_dump(by_alias=True, exclude_none=True)
        if not isinstance(response_format, Mapping):
            raise _bad("response_format must be an object.", PARAM_RESPONSE_FORMAT)
        kind = response_format.get("type")
        if kind == "text":
            return None
        try:
            if kind == "json_object":
                return cls(json_object=True, _param=PARAM_RESPONSE_FORMAT)
            if kind == "json_schema":
                spec = response_format.get("json_schema")
                if not isinstance(spec, Mapping):
                    raise _bad("response_format.json_schema must be an object with a 'schema'.",
                               PARAM_RESPONSE_FORMAT)
                schema = spec.get("schema", spec.get("schema_"))
                if schema is None:
                    raise _bad("response_format.json_schema.schema is required.", PARAM_RESPONSE_FORMAT)
                return cls(json=schema, _param=PARAM_RESPONSE_FORMAT)
            if kind == "structural_tag":
                return cls(structural_tag=dict(response_format), _param=PARAM_RESPONSE_FORMAT)
        except StructuredOutputError as e:
            raise e.with_param(PARAM_RESPONSE_FORMAT) from None
        raise _bad(f"response_format.type must be one of text, json_object, json_schema, structural_tag; "
                   f"got {kind!r}.", PARAM_RESPONSE_FORMAT)

    def __repr__(self) -> str:
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else _json.dumps(value, ensure_ascii=False, default=str)
        shown = repr(text) if len(text) <= _REPR_CHARS else f"{text[:_REPR_CHARS]!r}...<{len(text)} chars>"
        flags = "".join(f", {name}=True" for name in ("disable_any_whitespace",
                                                      "disable_additional_properties") if getattr(self, name))
        return f"StructuredOutputsParams({self.kind}={shown}{flags})"
