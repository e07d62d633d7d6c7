"""Constrained decoding over HTTP on a tiny random Llama with an adapter: OpenAI's ``response_format``
(``json_schema``, ``json_object``) on /v1/chat/completions, vLLM's ``structured_outputs`` on both routes,
streamed and not, with ``n`` > 1 and logprobs, base model and adapter; each bad constraint is a 400 in
OpenAI's error body naming the field with the compiler's reason, after which the engine holds nothing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.core_messages import GetStats
from tests.conftest import TINY_PROMPTS
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.server.conftest import start_server
from tests.structured_output.cases import CHOICES, GRAMMAR, REGEX, SCHEMA, check_text

MODEL = "tiny-llama"
ADAPTER = "adapter-a"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    adapter = build_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("so-server") / "a", r=8,
                                 lora_alpha=16, target_modules=ALL_TARGETS, seed=3)
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=512,
                       lora_modules=[f"{ADAPTER}={adapter}"])
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(content: str = "Hello", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": MAX_TOKENS, **fields}


def stream_text(server, path: str, body: dict) -> tuple[dict[int, str], dict[int, str]]:
    """(choice index -> streamed text, choice index -> finish_reason) of an SSE response."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
                if choice.get("finish_reason"):
                    finish[choice["index"]] = choice["finish_reason"]
    return texts, finish


def assert_idle(server) -> None:
    stats = server.call_engine(GetStats())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.num_kv_blocks_in_use == 0
    assert server.engine_client._transport.core.scheduler.structured_output.num_requests() == 0


JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("model", [MODEL, ADAPTER])
def test_chat_response_format_json_schema(server, model):
    """OpenAI's json_schema (any whitespace between JSON tokens, which a random model likes to write: a
    reply may run out of tokens; those that end validate)."""
    done = 0
    for prompt in TINY_PROMPTS:
        r = post(server, "/v1/chat/completions", {**chat(prompt, response_format=JSON_SCHEMA_FORMAT,
                                                         max_tokens=160), "model": model})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            check_text("json", choice["message"]["content"])
            done += 1
        else:
            assert choice["message"]["content"].startswith("{")
    assert done >= 1


def test_chat_json_object_streamed_and_not(server):
    body = chat(response_format={"type": "json_object"}, max_tokens=48)
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    texts, finish = stream_text(server, "/v1/chat/completions", body)
    assert texts[0] == choice["message"]["content"] and finish[0] == choice["finish_reason"]
    if choice["finish_reason"] == "stop":
        check_text("json_object", texts[0])
    else:
        assert texts[0].startswith("{")
    assert_idle(server)


@pytest.mark.parametrize("kind, value", [("regex", REGEX), ("choice", CHOICES), ("grammar", GRAMMAR)])
def test_completions_structured_outputs_streamed_with_n(server, kind, value):
    body = {"model": ADAPTER, "prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "n": 2,
            "temperature": 1.0, "seed": 11, "structured_outputs": {kind: value}}
    texts, finish = stream_text(server, "/v1/completions", body)
    assert sorted(texts) == [0, 1] and finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        check_text(kind, text)
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert sorted(c["text"] for c in r.json()["choices"]) == sorted(texts.values())   # seeded: the same
    assert_idle(server)


def test_chat_structured_outputs_with_logprobs_and_the_openai_client(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2,
                                           extra_body={"structured_outputs": {"choice": CHOICES}})
    choice = reply.choices[0]
    check_text("choice", choice.message.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content + "<|im_end|>"
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    parsed = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA_FORMAT)
    assert parsed.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("path, fields, param, reason", [
    ("/v1/chat/completions",
     {"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "Unsupported type"),
    ("/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema is required"),
    ("/v1/chat/completions",
     {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "cannot be combined"),
    ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs", "parenthesis"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs",
     'Rule "missing" is not defined'),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one kind"),
    ("/v1/completions", {"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unsupported field"),
], ids=["invalid-schema", "unsupported-keyword", "unknown-type", "no-schema", "both-fields", "bad-regex",
        "bad-grammar", "two-kinds", "unknown-field"])
def test_bad_constraint_is_a_400_naming_the_field(server, path, fields, param, reason):
    body = chat(**fields) if path.endswith("chat/completions") else {
        "model": MODEL, "prompt": "Hello", "max_tokens": 8, **fields}
    for stream in (False, True):
        r = post(server, path, {**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError", err
        assert reason in err["message"] and err["message"].startswith(param), err
    assert_idle(server)
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": MAX_TOKENS,
                                          "temperature": 0, "structured_outputs": {"regex": REGEX}})
    check_text("regex", ok.json()["choices"][0]["text"])


def test_engine_process_validates_in_the_api_process(tiny_llama_dir):
    """--engine-process: the request processor (with a copy of the compile pool, rebuilt from its arguments
    to check specs only) runs in the API process; a bad constraint is refused there, a good one is compiled
    by the engine alone."""
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=256, engine_process=True)
    try:
        bad = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                            "structured_outputs": {"regex": "(a"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs", bad.text
        ok = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": MAX_TOKENS,
                                           "temperature": 0, "structured_outputs": {"choice": CHOICES}})
        assert ok.status_code == 200, ok.text
        check_text("choice", ok.json()["choices"][0]["text"])
    finally:
        srv.stop()
