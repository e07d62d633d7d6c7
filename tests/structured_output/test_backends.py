"""Both backends on SmolLM2's real tokenizer: a random-logits "model" constrained by each kind of spec
produces output that matches it; bad specs raise the compiler's reason; matchers roll back."""

from __future__ import annotations

import json
import re

import pytest

from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.guidance_backend import GuidanceBackend
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.spec import GrammarSpec
from engine.structured_output.xgrammar_backend import XgrammarBackend
from tests.structured_output.utils import (SMOL_EOS, SMOL_VOCAB_SIZE, allowed_ids, decode, mask_after,
                                           random_logits_generate, smol_tokenizer)

BACKENDS = ("xgrammar", "guidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "active": {"type": "boolean"},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"]},
    },
    "required": ["name", "age", "role", "address"],
}


@pytest.fixture(scope="module")
def backends():
    tok = smol_tokenizer()
    return {"xgrammar": XgrammarBackend(tok, SMOL_VOCAB_SIZE),
            "guidance": GuidanceBackend(tok, SMOL_VOCAB_SIZE)}


def compile_spec(backends, name, **params):
    return backends[name].compile(GrammarSpec.from_params(StructuredOutputsParams(**params)))


def generate_text(backends, name, seed=0, **params) -> str:
    matcher = compile_spec(backends, name, **params).new_matcher()
    ids = random_logits_generate(matcher, SMOL_VOCAB_SIZE, seed=seed)
    assert ids[-1] == SMOL_EOS and matcher.is_terminated()
    return decode(smol_tokenizer(), ids, [SMOL_EOS])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", BACKENDS)
def test_json_schema_output_validates(backends, name, seed):
    jsonschema = pytest.importorskip("jsonschema")
    # No unlisted properties: the guidance backend would otherwise let the random model add them forever.
    text = generate_text(backends, name, seed=seed, json=PERSON, disable_any_whitespace=True,
                         disable_additional_properties=True)
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # compact


@pytest.mark.parametrize("name,extra_allowed", [("xgrammar", False), ("guidance", True)])
def test_additional_properties(backends, name, extra_allowed):
    tok = smol_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    extra = tok.encode('{"a": 1, "b": 2}', add_special_tokens=False)
    assert compile_spec(backends, name, json=schema).new_matcher().accept_tokens(extra) == extra_allowed
    closed = compile_spec(backends, name, json=schema, disable_additional_properties=True)
    assert not closed.new_matcher().accept_tokens(extra)
    assert closed.new_matcher().accept_tokens(tok.encode('{"a": 1}', add_special_tokens=False))


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_output_matches(backends, name):
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    for seed in range(3):
        text = generate_text(backends, name, seed=seed, regex=pattern)
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("name", BACKENDS)
def test_choice_output_is_one_of_them(backends, name):
    choices = ["red", "green", 'say "hi"\\n', "zürich 😀"]
    seen = {generate_text(backends, name, seed=seed, choice=choices) for seed in range(6)}
    assert seen <= set(choices) and len(seen) > 1


@pytest.mark.parametrize("name", BACKENDS)
def test_ebnf_grammar_output_parses(backends, name):
    grammar = ('root ::= num (" " op " " num){0,3}\n'
               'num ::= [1-9] [0-9]{0,2}\n'
               'op ::= "+" | "-" | "*"\n')
    for seed in range(3):
        text = generate_text(backends, name, seed=seed, grammar=grammar)
        assert re.fullmatch(r"[1-9][0-9]{0,2}( [-+*] [1-9][0-9]{0,2}){0,3}", text), text


@pytest.mark.parametrize("name", BACKENDS)
def test_json_object(backends, name):
    tok = smol_tokenizer()
    grammar = compile_spec(backends, name, json_object=True)
    first = allowed_ids(mask_after(grammar.new_matcher(), SMOL_VOCAB_SIZE), SMOL_VOCAB_SIZE)
    assert tok.convert_tokens_to_ids("{") in first
    assert all(tok.decode([t]).strip() in ("", "{") or tok.decode([t]).lstrip().startswith("{")
               for t in first)
    good = tok.encode('{"a": [1, 2.5, "x"], "b": {"c": null, "d": true}}', add_special_tokens=False)
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(good) and not matcher.is_terminated()
    assert matcher.accept_tokens([SMOL_EOS]) and matcher.is_terminated()
    for bad in ("[1, 2]", '"text"', '{"a": }'):
        assert not grammar.new_matcher().accept_tokens(tok.encode(bad, add_special_tokens=False)), bad


@pytest.mark.parametrize("name,params,reason", [
    ("xgrammar", {"json": {"type": "foo"}}, 'Unsupported type "foo"'),
    ("guidance", {"json": {"type": "foo"}}, "foo"),
    ("xgrammar", {"json": {"type": "object", "required": "a"}}, "required must be an array"),
    ("guidance", {"json": {"$ref": "#/$defs/missing"}}, "/$defs/missing"),
    ("xgrammar", {"regex": "[a-"}, "Unclosed '['"),
    ("guidance", {"regex": "[a-"}, "unclosed character class"),
    ("xgrammar", {"regex": "(a)\\1"}, "Backreference is not supported"),
    ("guidance", {"regex": "(a)\\1"}, "backreferences are not supported"),
    ("xgrammar", {"grammar": 'root ::= ("a"'}, "Expect )"),
    ("guidance", {"grammar": 'root ::= ("a"'}, "Expected ')'"),
    ("xgrammar", {"grammar": 'root ::= "a" foo'}, 'Rule "foo" is not defined'),
    ("guidance", {"grammar": 'root ::= "a" foo'}, "Rule 'foo' not found"),
    ("guidance", {"json": {"type": "array", "uniqueItems": True}}, 'Unimplemented keys: ["uniqueItems"]'),
    ("xgrammar", {"json": {"type": "array", "uniqueItems": True}}, "does not enforce the JSON schema's "
                                                                    "'uniqueItems' at /"),
    ("guidance", {"structural_tag": {"type": "structural_tag", "format": {}}}, "'structures'"),
])
def test_bad_spec_raises_the_compiler_reason(backends, name, params, reason):
    with pytest.raises(StructuredOutputError) as info:
        compile_spec(backends, name, **params)
    assert reason in str(info.value) and info.value.backend == name
    assert "/project/cpp" not in str(info.value)  # xgrammar's source location is cut


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_restores_the_mask(backends, name):
    tok = smol_tokenizer()
    grammar = compile_spec(backends, name, json={"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]})
    matcher = grammar.new_matcher()
    ids = tok.encode('{"name": "ab", "n": 12}', add_special_tokens=False)
    masks = []
    for token in ids:
        masks.append(mask_after(matcher, SMOL_VOCAB_SIZE))
        assert matcher.accept_tokens([token])
    masks.append(mask_after(matcher, SMOL_VOCAB_SIZE))
    assert matcher.accept_tokens([SMOL_EOS]) and matcher.is_terminated()
    matcher.rollback(1)  # the stop token
    assert not matcher.is_terminated()
    assert mask_after(matcher, SMOL_VOCAB_SIZE).equal(masks[-1])
    matcher.rollback(3)
    assert mask_after(matcher, SMOL_VOCAB_SIZE).equal(masks[len(ids) - 3])
    assert matcher.accept_tokens(ids[-3:]) and matcher.accept_tokens([SMOL_EOS]) and matcher.is_terminated()
    matcher.reset()
    assert mask_after(matcher, SMOL_VOCAB_SIZE).equal(masks[0]) and not matcher.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_accept_is_all_or_nothing(backends, name):
    tok = smol_tokenizer()
    matcher = compile_spec(backends, name, regex="ab+c").new_matcher()
    a, b, c, x = (tok.convert_tokens_to_ids(t) for t in "abcx")
    assert matcher.accept_tokens([a, b])
    before = mask_after(matcher, SMOL_VOCAB_SIZE)
    assert not matcher.accept_tokens([b, c, x])  # x is not allowed: b and c are not taken either
    assert mask_after(matcher, SMOL_VOCAB_SIZE).equal(before)
    assert not matcher.accept_tokens([SMOL_EOS])  # the grammar is not complete
    assert not matcher.accept_tokens([SMOL_VOCAB_SIZE + 5])  # an id outside the vocabulary
    assert matcher.accept_tokens([b, c, SMOL_EOS]) and matcher.is_terminated()
    assert not matcher.accept_tokens([a])  # nothing after the end
    matcher.fill_bitmask(bitmask := before.clone().unsqueeze(0).zero_(), 0)
    assert bool((bitmask == -1).all())  # a terminated matcher no longer constrains


@pytest.mark.parametrize("name", BACKENDS)
def test_structural_tag_structures_form(backends, name):
    tok = smol_tokenizer()
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "end": "</function>",
                           "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}}]}
    grammar = compile_spec(backends, name, structural_tag=tag)
    good = 'It is <function=get_weather>{"city": "Paris"}</function> done'
    assert grammar.new_matcher().accept_tokens(tok.encode(good, add_special_tokens=False))
    bad = 'It is <function=get_weather>{"town": 1}</function>'
    assert not grammar.new_matcher().accept_tokens(tok.encode(bad, add_special_tokens=False))


def test_xgrammar_structural_tag_format_form(backends):
    tok = smol_tokenizer()
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}
    grammar = compile_spec(backends, "xgrammar", structural_tag=tag)
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(tok.encode("hello", add_special_tokens=False) + [SMOL_EOS])
    assert matcher.is_terminated()
