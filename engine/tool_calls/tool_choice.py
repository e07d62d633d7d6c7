"""``tools`` + ``tool_choice`` + ``parallel_tool_calls`` of a chat request: checked (a 400 naming the field),
resolved to one of ``none | auto | required | named``, and, for ``required`` and a named function, the
JSON schema that constrains the reply so it always parses (as vLLM does).

Constrained reply formats (read by ``parse_constrained`` and ``engine.tool_calls.constrained``):

- ``required``: a JSON list of one or more calls (exactly one when ``parallel_tool_calls`` is false)::

      [{"name": "get_weather", "parameters": {"city": "Paris"}}]

  each item ``{"name": <one of the tools' names>, "parameters": <that tool's parameters schema>}``
  and nothing else (``additionalProperties: false``);
- a named function (``{"type": "function", "function": {"name": "get_weather"}}``): the arguments
  object itself, ``{"city": "Paris"}``, following that tool's ``parameters`` schema.

A tool without ``parameters`` takes ``{"type": "object", "properties": {}}``. The tools' ``$defs`` (and
``definitions``) move to the root of the ``required`` schema, where their ``#/$defs/...`` references
point; two tools defining one name differently is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional

from engine.tool_calls.constrained import ConstrainedToolParser
from engine.tool_calls.ids import IdFactory
from engine.tool_calls.parser import ToolCall

ToolChoiceMode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The parameters schema of a tool that declares none."""
_DEFINITION_KEYS = ("$defs", "definitions")
NAMED_CHOICE_USAGE = '{"type": "function", "function": {"name": "my_function"}}'


class ToolChoiceError(ValueError):
    """A bad ``tools`` / ``tool_choice`` (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
        """``tools``, ``tool_choice`` or ``parallel_tool_calls``."""


@dataclass(frozen=True)
class ResolvedToolChoice:
    """What a request's tool fields ask for."""

    mode: ToolChoiceMode
    """``none``: no calls; ``auto``: calls parsed from free text (``--tool-call-parser``); ``required`` and
    ``named``: the reply is constrained by ``tool_choice_schema``."""
    function_name: Optional[str] = None
    """The named function (mode ``named``)."""
    parallel_tool_calls: bool = True
    """More than one call may be made."""

    @property
    def constrained(self) -> bool:
        """The reply follows a JSON schema (``required`` or ``named``)."""
        return self.mode in ("required", "named")


def function_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """``tools`` checked: name -> the tool's ``function`` (``name``, ``description``, ``parameters``).
    ToolChoiceError (param ``tools``) for a malformed tool or a name given twice."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise ToolChoiceError(f"tools must be a list of function tools, got {type(tools).__name__}.", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolChoiceError(f"{where} must be an object like {{'type': 'function', 'function': "
                                  f"{{'name': ...}}}}, got {type(tool).__name__}.", "tools")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ToolChoiceError(f"{where}.type {kind!r} is not supported; only 'function' tools are.",
                                  "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolChoiceError(f"{where}.function must be an object with a 'name'.", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolChoiceError(f"{where}.function.name must be a non-empty string.", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolChoiceError(f"{where}.function.parameters must be a JSON schema object, got "
                                  f"{type(parameters).__name__}.", "tools")
        if name in out:
            raise ToolChoiceError(f"{where}: the function name {name!r} is given twice; tool names must be "
                                  "unique.", "tools")
        out[name] = function
    return out


def resolve_tool_choice(tools: Any, tool_choice: Any, parallel_tool_calls: Optional[bool] = None, *,
                        auto_enabled: bool) -> ResolvedToolChoice:
    """Check a request's tool fields and say what they ask for.

    Args:
        tools: the request's ``tools`` (None or a list of function tools).
        tool_choice: None (``auto`` when there are tools, else ``none``), ``"none"``, ``"auto"``,
            ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
        parallel_tool_calls: None means true.
        auto_enabled: the server runs with ``--enable-auto-tool-choice`` and a ``--tool-call-parser``.

    Raises:
        ToolChoiceError: malformed tools, an unknown choice, a named function that is not among the
            tools, ``auto`` / ``required`` / a named function without tools, or ``auto`` on a server
            without ``--enable-auto-tool-choice``.
    """
    functions = function_tools(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ResolvedToolChoice("none", parallel_tool_calls=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ToolChoiceError(f"tool_choice {tool_choice!r} is not supported: use 'none', 'auto', "
                                  f"'required' or a named function ({NAMED_CHOICE_USAGE}).", "tool_choice")
        if not functions:
            raise ToolChoiceError(f"tool_choice {tool_choice!r} needs tools; the request has none.",
                                  "tool_choice")
        if tool_choice == "auto" and not auto_enabled:
            raise ToolChoiceError('"auto" tool choice requires the server to run with '
                                  '--enable-auto-tool-choice and --tool-call-parser; send tool_choice '
                                  '"required", a named function or "none" instead.', "tool_choice")
        return ResolvedToolChoice(tool_choice, parallel_tool_calls=parallel)   # type: ignore[arg-type]
    name = _named_function(tool_choice)
    if not functions:
        raise ToolChoiceError(f"tool_choice names the function {name!r} but the request has no tools.",
                              "tool_choice")
    if name not in functions:
        raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the request's "
                              f"tools ({', '.join(repr(n) for n in functions)}).", "tool_choice")
    return ResolvedToolChoice("named", function_name=name, parallel_tool_calls=parallel)


def _named_function(tool_choice: Any) -> str:
    if not isinstance(tool_choice, dict):
        raise ToolChoiceError(f"tool_choice must be 'none', 'auto', 'required' or an object "
                              f"{NAMED_CHOICE_USAGE}, got {type(tool_choice).__name__}.", "tool_choice")
    if tool_choice.get("type", "function") != "function":
        raise ToolChoiceError(f"tool_choice.type {tool_choice.get('type')!r} is not supported; use "
                              f"{NAMED_CHOICE_USAGE}.", "tool_choice")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ToolChoiceError(f"tool_choice.function.name must be a non-empty string: {NAMED_CHOICE_USAGE}.",
                              "tool_choice")
    return name


def tool_choice_schema(tools: Any, choice: ResolvedToolChoice) -> Optional[dict[str, Any]]:
    """The JSON schema that constrains the reply of a ``required`` or named choice; None otherwise."""
    functions = function_tools(tools)
    if choice.mode == "required":
        return required_schema(functions, choice.parallel_tool_calls)
    if choice.mode == "named":
        assert choice.function_name is not None
        return dict(functions[choice.function_name].get("parameters") or EMPTY_PARAMETERS)
    return None


def required_schema(functions: dict[str, dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """A list of 1+ calls (exactly 1 without ``parallel_tool_calls``), each ``{"name", "parameters"}`` of
    one of ``functions`` (name -> function, from ``function_tools``)."""
    definitions: dict[str, dict[str, Any]] = {}
    items = []
    for name, function in functions.items():
        parameters = dict(function.get("parameters") or EMPTY_PARAMETERS)
        for key in _DEFINITION_KEYS:
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                known = definitions.setdefault(key, {})
                if def_name in known and known[def_name] != schema:
                    raise ToolChoiceError(f"Tools define {key} {def_name!r} differently (in function "
                                          f"{name!r}); tool_choice 'required' needs one definition per name.",
                                          "tools")
                known[def_name] = schema
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(definitions)
    return schema


def parse_constrained(text: str, function_name: Optional[str] = None,
                      id_factory: Optional[IdFactory] = None) -> list[ToolCall]:
    """The calls of a constrained reply (the module doc's formats): ``function_name`` None reads a
    ``required`` list, otherwise the named function's arguments object. Arguments are the JSON text
    as written. ValueError when the text is not that format (a reply cut short by ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"The constrained tool-call reply is not valid JSON ({e}).") from None
    extracted = ConstrainedToolParser(function_name, id_factory).extract(text)
    if function_name is not None:
        if not isinstance(value, dict):
            raise ValueError("The named function's reply is not a JSON object.")
        return extracted.tool_calls
    if (not isinstance(value, list) or not value or extracted.content is not None
            or len(extracted.tool_calls) != len(value)):
        raise ValueError('The tool_choice "required" reply is not a list of calls '
                         '[{"name": ..., "parameters": {...}}].')
    return extracted.tool_calls
