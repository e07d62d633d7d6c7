"""The JSON schema keywords xgrammar compiles without enforcing: a schema using one is sent to the guidance
backend by ``auto`` and refused by ``xgrammar`` (it would produce output the schema rejects).

The list is what xgrammar's JSON schema converter does with each keyword, found by compiling schemas
and feeding the matcher output the keyword forbids: these keywords accept it. Keywords xgrammar rejects
outright (an error at compile time) need no entry: the compile error itself triggers the fallback.
"""

from __future__ import annotations

from typing import Any

UNENFORCED_KEYWORDS: tuple[str, ...] = (
    "uniqueItems", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies")
"""Keywords xgrammar accepts and ignores (the guidance backend enforces some, rejects the others)."""

_SCHEMA_VALUED = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "not", "if", "then", "else")
"""Keywords whose value is one subschema."""
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
"""Keywords whose value is a list of subschemas (``items`` in its draft-7 tuple form)."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
"""Keywords whose value maps names to subschemas (``dependencies`` also holds lists of names)."""


def xgrammar_unenforced(schema: Any) -> list[str]:
    """What in ``schema`` xgrammar would not enforce, each as ``'keyword' at /json/pointer``: the
    ``UNENFORCED_KEYWORDS``, an ``allOf`` of more than one schema (xgrammar does not enforce the
    conjunction), a string length bound beside a ``pattern`` or ``format`` (xgrammar keeps the pattern and
    drops the bound), and a ``$ref`` to another document. Property names and ``enum`` / ``const`` values
    are data, never keywords."""
    found: list[str] = []
    _walk(schema, "", found)
    return found


def _walk(schema: Any, path: str, found: list[str]) -> None:
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            found.append(f"'{keyword}' at {path or '/'}")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        found.append(f"'allOf' of {len(all_of)} schemas at {path or '/'}")
    shaped = [k for k in ("pattern", "format") if k in schema]
    if shaped:
        for bound in ("minLength", "maxLength"):
            if bound in schema:
                found.append(f"'{bound}' with '{shaped[0]}' at {path or '/'}")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"'$ref' to another document ({ref}) at {path or '/'}")
    for keyword in _SCHEMA_VALUED:
        if isinstance(schema.get(keyword), dict):
            _walk(schema[keyword], f"{path}/{_escape(keyword)}", found)
    for keyword in _SCHEMA_LISTS:
        value = schema.get(keyword)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{path}/{_escape(keyword)}/{i}", found)
    for keyword in _SCHEMA_MAPS:
        value = schema.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/{_escape(keyword)}/{_escape(str(name))}", found)


def _escape(token: str) -> str:
    """A JSON pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")
