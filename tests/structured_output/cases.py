"""Constraints the tiny random model can finish within a few dozen tokens (bounded languages), and the checks
that its outputs follow them, shared by the offline and the HTTP engine tests."""

from __future__ import annotations

import json
import re

import jsonschema

from engine.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
"""A JSON schema with a bounded language (compact whitespace: ``disable_any_whitespace``)."""
REGEX = r"[a-z]{2,4}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "x"'
"""GBNF: one or two items in parentheses."""
GRAMMAR_AS_REGEX = r"\((?:[0-9]|x)(?:,(?:[0-9]|x))?\)"
"""The same language as a Python regex."""
KINDS = ("json", "regex", "choice", "grammar")


def constraint(kind: str) -> StructuredOutputsParams:
    """The bounded constraint of ``kind`` (``KINDS``)."""
    if kind == "json":
        return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=REGEX)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(CHOICES))
    if kind == "grammar":
        return StructuredOutputsParams(grammar=GRAMMAR)
    raise ValueError(kind)


def check_text(kind: str, text: str) -> None:
    """AssertionError unless ``text`` is in the language of ``constraint(kind)`` (or an object for
    ``json_object``)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_AS_REGEX, text), text
    else:
        raise ValueError(kind)
