"""Talk to a running ``chorus serve`` with the official OpenAI SDK: one reply, then a streamed one.

    .venv/bin/chorus serve --port 8000      # in another terminal (no MODEL: SmolLM2-135M-Instruct)
    .venv/bin/pip install -q openai         # the SDK (the test extra has it too)
    .venv/bin/python examples/openai_chat.py    # CHORUS_URL / CHORUS_API_KEY to point elsewhere
"""

from __future__ import annotations

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("CHORUS_URL", "http://127.0.0.1:8000") + "/v1",
                api_key=os.environ.get("CHORUS_API_KEY", "EMPTY"))
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "What is the capital of France?"}]

reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
print(reply.choices[0].message.content)
print(f"[{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens]")

messages += [{"role": "assistant", "content": reply.choices[0].message.content},
             {"role": "user", "content": "Tell me one fact about it."}]
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens streamed]")
