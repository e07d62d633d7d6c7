"""``auto`` falls back to the guidance backend for what xgrammar lacks (real examples), and the walker
that finds the JSON schema keywords xgrammar would ignore."""

from __future__ import annotations

import pytest

from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.json_schema_features import xgrammar_unenforced
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.selection import AutoBackend, make_backend
from engine.structured_output.spec import GrammarSpec
from tests.structured_output.utils import SMOL_EOS, SMOL_VOCAB_SIZE, smol_tokenizer


@pytest.fixture(scope="module")
def auto():
    return AutoBackend(smol_tokenizer(), SMOL_VOCAB_SIZE)


def spec(**params) -> GrammarSpec:
    return GrammarSpec.from_params(StructuredOutputsParams(**params))


def accepts(grammar, text: str) -> bool:
    ids = smol_tokenizer().encode(text, add_special_tokens=False)
    matcher = grammar.new_matcher()
    return matcher.accept_tokens(ids) and matcher.accept_tokens([SMOL_EOS])


@pytest.mark.parametrize("params,good,bad", [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, '{"a": 1}', '{"a": "x"}'),
    ({"regex": r"\d{3}-\d{4}"}, "555-1234", "5551234"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'root ::= "a" | "b"'}, "b", "c"),
    ({"json_object": True}, '{"k": [1]}', "[1]"),
])
def test_auto_prefers_xgrammar(auto, params, good, bad):
    grammar = auto.compile(spec(**params))
    assert grammar.backend == "xgrammar"
    assert accepts(grammar, good) and not accepts(grammar, bad)


@pytest.mark.parametrize("params,good,bad,why", [
    # xgrammar's regex parser rejects these; llguidance's (Rust regex syntax) takes them.
    ({"regex": "(?i)abc"}, "AbC", "abd", "Group modifier flag is not supported"),
    ({"regex": r"\p{L}+"}, "héllo", "h3llo", "Unicode character class escape"),
    ({"regex": "(?P<x>a)b"}, "ab", "b", "Group modifier flag is not supported"),
    # A Lark grammar (xgrammar reads GBNF only).
    ({"grammar": 'start: "a" | "b"'}, "a", "c", "EBNF lexer error"),
    # xgrammar generates no unlisted property, so it refuses minProperties beyond the listed ones.
    ({"json": {"type": "object", "minProperties": 2}}, '{"x": 1, "y": 2}', '{"x": 1}',
     "minProperties is greater than the number of properties"),
    # draft-7 tuple items.
    ({"json": {"type": "array", "items": [{"type": "integer"}], "additionalItems": False}}, "[1]", "[1, 2]",
     "items must be a boolean or an object"),
    # xgrammar compiles these but does not enforce them (json_schema_features): routed to guidance.
    ({"json": {"allOf": [{"type": "integer"}, {"minimum": 5}]}}, "7", "3", "'allOf' of 2 schemas"),
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [
        {"required": ["a"]}, {"properties": {"a": {"maximum": 9}}}]}}, '{"a": 3}', "{}", "'allOf' of 2"),
    # xgrammar keeps a pattern or format and drops the string's length bounds beside it.
    ({"json": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}}, '"abc"', '"abcdefgh"',
     "'maxLength' with 'pattern'"),
])
def test_auto_falls_back_to_guidance(auto, params, good, bad, why):
    xgrammar = make_backend("xgrammar", smol_tokenizer(), SMOL_VOCAB_SIZE)
    with pytest.raises(StructuredOutputError, match=why.replace("(", r"\(").replace("[", r"\[")):
        xgrammar.compile(spec(**params))
    grammar = auto.compile(spec(**params))
    assert grammar.backend == "guidance"
    assert accepts(grammar, good) and not accepts(grammar, bad)


@pytest.mark.parametrize("params,why,backend", [
    # Neither backend: the reason is the one of the backend that would have served it.
    ({"json": {"type": "array", "uniqueItems": True}}, 'Unimplemented keys: ["uniqueItems"]', "guidance"),
    ({"json": {"not": {"type": "string"}}}, 'Unimplemented keys: ["not"]', "guidance"),
    ({"regex": "(a)\\1"}, "Backreference is not supported", "xgrammar"),
    ({"regex": "[a-"}, "Unclosed '['", "xgrammar"),
    ({"grammar": "?? bad"}, 'The root rule with name "root" is not found', "xgrammar"),
    ({"json": {"type": "foo"}}, 'Unsupported type "foo"', "xgrammar"),
])
def test_auto_when_neither_backend_serves(auto, params, why, backend):
    with pytest.raises(StructuredOutputError) as info:
        auto.compile(spec(**params))
    assert why in str(info.value) and info.value.backend == backend


def test_unenforced_keywords_walker():
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},  # a property named like a keyword is not the keyword
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "ok": {"allOf": [{"$ref": "#/$defs/x"}]},  # one-schema allOf: xgrammar reads it
            "remote": {"$ref": "https://example.com/s.json"},
        },
        "enum": [{"if": 1}],  # data, not a schema
        "$defs": {"x": {"if": {"type": "string"}, "then": {"maxLength": 2}}, "a/b": {"not": {}}},
        "anyOf": [{"dependentRequired": {"a": ["b"]}}],
    }
    assert sorted(xgrammar_unenforced(schema)) == sorted([
        "'if' at /$defs/x", "'then' at /$defs/x", "'not' at /$defs/a~1b",
        "'uniqueItems' at /properties/tags",
        "'$ref' to another document (https://example.com/s.json) at /properties/remote",
        "'dependentRequired' at /anyOf/0"])
    assert xgrammar_unenforced({"type": "object", "properties": {"a": {"type": "integer"}}}) == []
    assert xgrammar_unenforced(True) == []


def test_named_backend_refuses_a_tokenizer_it_cannot_read():
    class NotATokenizer:
        pass

    for name in ("xgrammar", "guidance"):
        with pytest.raises(StructuredOutputError, match="cannot read this model's tokenizer"):
            make_backend(name, NotATokenizer(), 1000)
    auto = make_backend("auto", NotATokenizer(), 1000)  # reads the tokenizer on first compile
    with pytest.raises(StructuredOutputError, match="cannot read this model's tokenizer"):
        auto.compile(spec(regex="a"))
    with pytest.raises(ValueError, match="must be one of auto, xgrammar, guidance"):
        make_backend("outlines", NotATokenizer(), 1000)
