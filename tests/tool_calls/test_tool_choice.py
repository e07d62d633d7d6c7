"""tools + tool_choice: the checks (a 400 naming the field), what each choice resolves to, the JSON schemas
that constrain required / named replies (checked with jsonschema against replies), and parse_constrained."""

from __future__ import annotations

import json

import pytest

from engine.tool_calls.ids import counting_ids
from engine.tool_calls.parser import ToolCall
from engine.tool_calls.tool_choice import (
    EMPTY_PARAMETERS,
    ResolvedToolChoice,
    ToolChoiceError,
    parse_constrained,
    resolve_tool_choice,
    tool_choice_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["city"], "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


@pytest.mark.parametrize("tools, choice, parallel, expected", [
    (None, None, None, ResolvedToolChoice("none")),
    (TOOLS, None, None, ResolvedToolChoice("auto")),
    (TOOLS, "none", None, ResolvedToolChoice("none")),
    (None, "none", None, ResolvedToolChoice("none")),
    (TOOLS, "auto", False, ResolvedToolChoice("auto", parallel_tool_calls=False)),
    (TOOLS, "required", None, ResolvedToolChoice("required")),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, None,
     ResolvedToolChoice("named", function_name="get_time")),
])
def test_resolve(tools, choice, parallel, expected):
    assert resolve_tool_choice(tools, choice, parallel, auto_enabled=True) == expected
    assert expected.constrained == (expected.mode in ("required", "named"))


@pytest.mark.parametrize("tools, choice, auto_enabled, param, message", [
    (TOOLS, {"type": "function", "function": {"name": "get_wether"}}, True, "tool_choice",
     ("tool_choice names the function 'get_wether', which is not among the request's tools "
      "('get_weather', 'get_time')")),
    (None, "required", True, "tool_choice", "tool_choice 'required' needs tools; the request has none"),
    ([], "required", True, "tool_choice", "needs tools"),
    (None, {"type": "function", "function": {"name": "f"}}, True, "tool_choice",
     "names the function 'f' but the request has no tools"),
    (None, "auto", True, "tool_choice", "tool_choice 'auto' needs tools"),
    (TOOLS, None, False, "tool_choice", "requires the server to run with --enable-auto-tool-choice"),
    (TOOLS, "auto", False, "tool_choice", "--tool-call-parser"),
    (TOOLS, "always", True, "tool_choice", "tool_choice 'always' is not supported"),
    (TOOLS, {"type": "function", "function": {}}, True, "tool_choice", "tool_choice.function.name must be"),
    (TOOLS, {"type": "retrieval"}, True, "tool_choice", "tool_choice.type 'retrieval' is not supported"),
    (TOOLS, 3, True, "tool_choice", "got int"),
    ({"name": "f"}, "auto", True, "tools", "tools must be a list"),
    ([{"type": "code_interpreter"}], "auto", True, "tools",
     "tools[0].type 'code_interpreter' is not supported"),
    ([{"type": "function"}], "auto", True, "tools", "tools[0].function must be an object"),
    ([{"type": "function", "function": {"name": ""}}], "auto", True, "tools", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", True, "tools",
     "tools[0].function.parameters must be a JSON schema object"),
    ([TIME, TIME], "auto", True, "tools", "tools[1]: the function name 'get_time' is given twice"),
])
def test_bad_tool_fields(tools, choice, auto_enabled, param, message):
    with pytest.raises(ToolChoiceError) as e:
        resolve_tool_choice(tools, choice, auto_enabled=auto_enabled)
    assert isinstance(e.value, ValueError)
    assert e.value.param == param
    assert message in str(e.value)


def _jsonschema():
    """jsonschema (the test extra's; the schema tests skip without it)."""
    return pytest.importorskip("jsonschema")


def _required_schema(parallel=True):
    return tool_choice_schema(TOOLS, resolve_tool_choice(TOOLS, "required", parallel, auto_enabled=False))


def test_required_schema_accepts_calls_and_refuses_the_rest():
    jsonschema = _jsonschema()
    schema = _required_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
             [{"name": "get_weather", "parameters": {"city": "Oslo"}},
              {"name": "get_time", "parameters": {}}]]
    invalid = [[], [{"name": "get_weather", "parameters": {}}],               # missing city
               [{"name": "get_weather", "parameters": {"city": "X", "unit": "kelvin"}}],   # $defs enum
               [{"name": "launch", "parameters": {}}], [{"name": "get_time"}],
               [{"name": "get_time", "parameters": {}, "extra": 1}], {"name": "get_time", "parameters": {}}]
    for reply in valid:
        jsonschema.validate(reply, schema)
        text = json.dumps(reply)
        calls = parse_constrained(text, id_factory=counting_ids())
        assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [(r["name"], r["parameters"])
                                                                          for r in reply]
    for reply in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(reply, schema)
    assert schema["$defs"] == {"unit": {"enum": ["celsius", "fahrenheit"]}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == EMPTY_PARAMETERS


def test_parallel_tool_calls_false_allows_exactly_one_call():
    jsonschema = _jsonschema()
    schema = _required_schema(parallel=False)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    assert "maxItems" not in _required_schema(parallel=True)


def test_named_schema_is_the_functions_parameters():
    choice = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                                 auto_enabled=False)
    assert tool_choice_schema(TOOLS, choice) == WEATHER["function"]["parameters"]
    time_choice = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                                      auto_enabled=False)
    assert tool_choice_schema(TOOLS, time_choice) == EMPTY_PARAMETERS
    assert tool_choice_schema(TOOLS, resolve_tool_choice(TOOLS, "auto", auto_enabled=True)) is None
    assert parse_constrained('{"city": "Paris"}', "get_weather", counting_ids()) == [
        ToolCall("call_0", "get_weather", '{"city": "Paris"}')]


def test_conflicting_defs_are_refused():
    a = {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"x": {"type": "string"}}}}}
    b = {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"x": {"type": "integer"}}}}}
    with pytest.raises(ToolChoiceError, match="define \\$defs 'x' differently") as e:
        tool_choice_schema([a, b], ResolvedToolChoice("required"))
    assert e.value.param == "tools"
    same = {"type": "function", "function": {"name": "c", "parameters": {"$defs": {"x": {"type": "string"}}}}}
    assert tool_choice_schema([a, same], ResolvedToolChoice("required"))["$defs"] == {"x": {"type": "string"}}


@pytest.mark.parametrize("text, name, message", [
    ('[{"name": "get_time", "parameters": {}', None, "not valid JSON"),      # cut by max_tokens
    ("[]", None, "not a list of calls"),
    ('{"name": "get_time", "parameters": {}}', None, "not a list of calls"),
    ('[{"name": "get_time", "parameters": {}}, 3]', None, "not a list of calls"),
    ('["get_time"]', None, "not a list of calls"),
    ("[1, 2]", "get_weather", "not a JSON object"),
    ('{"city": ', "get_weather", "not valid JSON"),
])
def test_parse_constrained_refuses_other_text(text, name, message):
    with pytest.raises(ValueError, match=message):
        parse_constrained(text, name)
