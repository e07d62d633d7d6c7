"""Tools offline: ``LLM.chat(tools=..., chat_template_kwargs=...)`` renders them as a served request does,
and a reply constrained by the ``required`` schema parses into calls that satisfy the tools' schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from engine.tool_calls.tool_choice import function_tools, parse_constrained, required_schema

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
            "{% if mood is defined %}MOOD:{{ mood }}|{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}|{% endfor %}assistant:")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), max_model_len=256, chat_template=TEMPLATE)


def test_tools_and_template_kwargs_reach_the_template(llm):
    out, = llm.chat(ASK, SamplingParams(max_tokens=1), use_tqdm=False, tools=[WEATHER],
                    chat_template_kwargs={"mood": "sunny"})
    assert out.prompt == "TOOLS:get_weather;|MOOD:sunny|user: Weather in Paris?|assistant:"
    plain, = llm.chat(ASK, SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.prompt == "user: Weather in Paris?|assistant:"


def test_a_reply_under_the_required_schema_is_calls(llm):
    schema = required_schema(function_tools([WEATHER]), parallel_tool_calls=False)
    params = SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    out, = llm.chat(ASK, params, use_tqdm=False, tools=[WEATHER])
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    (call,) = parse_constrained(out.outputs[0].text)
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments_json), WEATHER["function"]["parameters"])
