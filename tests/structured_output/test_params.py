"""StructuredOutputsParams validation, OpenAI response_format, SamplingParams' field, GrammarSpec."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.spec import GrammarKind, GrammarSpec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("kwargs,kind", [
    ({"json": SCHEMA}, "json"), ({"json": '{"type": "integer"}'}, "json"), ({"json": True}, "json"),
    ({"regex": r"\d+"}, "regex"), ({"choice": ["a", "b"]}, "choice"),
    ({"grammar": 'root ::= "a"'}, "grammar"), ({"json_object": True}, "json_object"),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
])
def test_one_kind(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind


@pytest.mark.parametrize("kwargs,message", [
    ({}, "must set one of json, regex, choice, grammar, json_object, structural_tag"),
    ({"json_object": False}, "must set one of"),
    ({"json": SCHEMA, "regex": "a"}, "sets json and regex; exactly one kind"),
    ({"choice": ["a"], "grammar": "root ::= \"a\"", "json_object": True}, "exactly one kind"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json": 3}, "must be a JSON schema"),
    ({"regex": 5}, "regex must be a string"),
    ({"choice": []}, "non-empty list of strings"),
    ({"choice": ["a", 1]}, "only strings"),
    ({"grammar": "  "}, "grammar must be a non-empty string"),
    ({"json_object": "yes"}, "json_object must be a boolean"),
    ({"structural_tag": "[1]"}, "structural_tag must be a JSON object"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a boolean"),
])
def test_invalid_params(kwargs, message):
    with pytest.raises(StructuredOutputError, match=message) as info:
        StructuredOutputsParams(**kwargs)
    assert isinstance(info.value, ValueError) and info.value.param == "structured_outputs"


def test_from_dict_rejects_unknown_fields():
    assert StructuredOutputsParams.from_dict({"regex": "a+"}).regex == "a+"
    with pytest.raises(StructuredOutputError, match="unsupported field.*whitespace_pattern"):
        StructuredOutputsParams.from_dict({"regex": "a+", "whitespace_pattern": " "})


def test_from_response_format():
    read = StructuredOutputsParams.from_response_format
    assert read(None) is None and read({"type": "text"}) is None
    assert read({"type": "json_object"}).json_object is True
    params = read({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert params.kind == "json" and params.json == SCHEMA
    tag = {"type": "structural_tag", "structures": [], "triggers": []}
    assert read(tag).structural_tag == tag


def test_from_response_format_openai_model():
    from openai.types.shared.response_format_json_schema import JSONSchema
    from openai.types.shared.response_format_json_schema import ResponseFormatJSONSchema as Model

    model = Model(type="json_schema", json_schema=JSONSchema(name="x", schema=SCHEMA, strict=True))
    assert StructuredOutputsParams.from_response_format(model).json == SCHEMA


@pytest.mark.parametrize("response_format,message", [
    ({"type": "xml"}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}, "not valid JSON"),
    ("json", "response_format must be an object"),
])
def test_bad_response_format_blames_response_format(response_format, message):
    with pytest.raises(StructuredOutputError, match=message) as info:
        StructuredOutputsParams.from_response_format(response_format)
    assert info.value.param == "response_format"


def test_sampling_params_field():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert params.structured_outputs.choice == ["yes", "no"]
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    assert SamplingParams().structured_outputs is None
    assert params.clone().structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")
    with pytest.raises(ValueError, match="exactly one kind"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


def test_sampling_params_repr_stays_bounded():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    text = repr(SamplingParams(structured_outputs=StructuredOutputsParams(json=huge)))
    assert "structured_outputs=StructuredOutputsParams(json=" in text and len(text) < 1000
    assert "chars>" in repr(StructuredOutputsParams(json=huge))


def test_spec_is_canonical_and_keeps_property_order():
    as_dict = GrammarSpec.from_params(StructuredOutputsParams(json=SCHEMA))
    as_text = GrammarSpec.from_params(StructuredOutputsParams(
        json='{ "type": "object",\n "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}'))
    assert as_dict == as_text and as_dict.key() == as_text.key()
    assert as_dict.kind is GrammarKind.JSON and as_dict.text.index('"b"') < as_dict.text.index('"a"')
    compact = GrammarSpec.from_params(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert compact.key() != as_dict.key() and not compact.any_whitespace
    reordered = GrammarSpec.from_params(StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}))
    assert reordered.key() != as_dict.key()  # property order is the generated order
    assert GrammarSpec.from_params(StructuredOutputsParams(choice=["x", "y"])).value() == ["x", "y"]
    assert GrammarSpec.from_params(StructuredOutputsParams(json_object=True)).text == ""


def test_error_pickles_with_its_param_and_backend():
    import pickle

    error = pickle.loads(pickle.dumps(StructuredOutputError("bad regex", param="response_format",
                                                            backend="xgrammar")))
    assert (str(error), error.param, error.backend) == ("bad regex", "response_format", "xgrammar")
