"""Completions and chat over real HTTP: parity with the offline LLM, SSE framing, usage, logprobs,
echo, n, stop, seeds, the official openai client, and /metrics moving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.conftest import TINY_PROMPTS

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def stream_raw(server, path: str, body: dict) -> tuple[httpx.Headers, str]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return r.headers, r.read().decode()


def sse_payloads(raw: str) -> list[dict]:
    """Check the framing exactly (``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``), return the JSONs."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    out = []
    for e in events[:-2]:
        assert e.startswith("data: {") and "\n" not in e, repr(e)
        body = e[len("data: "):]
        assert body == json.dumps(json.loads(body), separators=(",", ":"), ensure_ascii=False)  # compact
        out.append(json.loads(body))
    return out


def token_ids_of(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in logprobs_tokens]


def offline_run(offline, prompt, **kw):
    return offline.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ----------------------------------------------------------------------------------------
def test_models_health_version(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_match_offline(server, offline, stream):
    """Greedy completions (several prompts in one request) give exactly the offline tokens."""
    prompts = TINY_PROMPTS[:4]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream": stream}
    texts, tokens = [""] * len(prompts), [[] for _ in prompts]
    if stream:
        _, raw = stream_raw(server, "/v1/completions", body)
        for chunk in sse_payloads(raw):
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                if c["logprobs"]:
                    tokens[c["index"]] += token_ids_of(c["logprobs"]["tokens"])
    else:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            texts[c["index"]] = c["text"]
            tokens[c["index"]] = token_ids_of(c["logprobs"]["tokens"])
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    assert tokens == [o.outputs[0].token_ids for o in ref]
    assert texts == [o.outputs[0].text for o in ref]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_offline(client, offline, stream):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        resp = client.chat.completions.create(**kw)
        text, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert resp.choices[0].message.role == "assistant"
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert text == ref.text
    assert finish == "length"


def test_seeded_sampling_matches_offline(server, offline):
    body = {"model": MODEL, "prompt": TINY_PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "top_p": 0.95,
            "top_k": 50, "seed": 1234, "ignore_eos": True}
    a = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    b = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    ref = offline_run(offline, TINY_PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.95, top_k=50,
                      seed=1234, ignore_eos=True).outputs[0].text
    assert a == b == ref


def test_completion_sse_framing(server):
    headers, raw = stream_raw(server, "/v1/completions", {
        "model": MODEL, "prompt": TINY_PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    assert headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(raw)
    *content, usage_chunk = chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert len({c["created"] for c in chunks}) == 1
    for c in content:
        assert list(c) == ["id", "object", "created", "model", "choices", "usage"]
        assert c["object"] == "text_completion" and c["model"] == MODEL and c["usage"] is None
        (choice,) = c["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    assert usage_chunk["choices"] == []
    full = post(server, "/v1/completions", {"model": MODEL, "prompt": TINY_PROMPTS[1], "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True}).json()
    assert usage_chunk["usage"] == {k: v for k, v in full["usage"].items() if v is not None}
    assert "".join(c["choices"][0]["text"] for c in content) == full["choices"][0]["text"]


def test_chat_sse_framing(server):
    messages = [{"role": "user", "content": "Hello"}]
    base = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, raw = stream_raw(server, "/v1/chat/completions", {**base, "stream": True})
    chunks = sse_payloads(raw)
    for c in chunks:  # no usage key at all unless asked for
        assert list(c) == ["id", "object", "created", "model", "choices"]
        assert c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-")
        (choice,) = c["choices"]
        assert list(choice) == ["index", "delta", "logprobs", "finish_reason"]
    first, *middle, last = [c["choices"][0] for c in chunks]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    assert middle and all(list(m["delta"]) == ["content"] and m["finish_reason"] is None for m in middle)
    assert last["delta"] == {} and last["finish_reason"] == "length"
    full = post(server, "/v1/chat/completions", base).json()
    assert "".join(m["delta"]["content"] for m in middle) == full["choices"][0]["message"]["content"]

    _, raw = stream_raw(server, "/v1/chat/completions",
                        {**base, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_payloads(raw)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]


def test_usage_counts(server):
    prompt = TINY_PROMPTS[2]
    count = post(server, "/tokenize", {"prompt": prompt})
    assert count.status_code == 200
    n_prompt = count.json()["count"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0,
                                         "ignore_eos": True, "n": 2}).json()
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 14, "total_tokens": n_prompt + 14,
                          "prompt_tokens_details": None}
    messages = [{"role": "user", "content": "Hi there"}]
    chat_count = post(server, "/tokenize", {"messages": messages}).json()["count"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 5,
                                              "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["prompt_tokens"] == chat_count
    assert r["usage"]["completion_tokens"] == 5 and r["usage"]["total_tokens"] == chat_count + 5


def test_n_prompt_list_and_token_ids(server, offline):
    tok = post(server, "/tokenize", {"prompt": TINY_PROMPTS[3]}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": tok}).json()["prompt"] == TINY_PROMPTS[3]
    by_text = post(server, "/v1/completions", {"model": MODEL, "prompt": [TINY_PROMPTS[0], TINY_PROMPTS[3]],
                                               "max_tokens": 6, "temperature": 0, "n": 2, "ignore_eos": True})
    by_ids = post(server, "/v1/completions", {"model": MODEL, "prompt": tok, "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})
    choices = by_text.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"]  # greedy samples agree
    assert choices[2]["text"] == by_ids.json()["choices"][0]["text"]
    ref = offline_run(offline, TINY_PROMPTS[3], max_tokens=6, temperature=0, ignore_eos=True)
    assert choices[3]["text"] == ref.outputs[0].text
    # A list of token-id lists is several prompts.
    two = post(server, "/v1/completions", {"model": MODEL, "prompt": [tok, tok], "max_tokens": 3,
                                           "temperature": 0}).json()
    assert len(two["choices"]) == 2 and two["usage"]["prompt_tokens"] == 2 * len(tok)


def test_completion_logprobs_shape(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": TINY_PROMPTS[0], "max_tokens": 6,
                                         "temperature": 0, "logprobs": 3, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert {len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")} == {6}
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # Keys are token strings, so byte-fallback tokens that all print as U+FFFD may collide.
        assert 1 <= len(top) <= 3 and token in top  # greedy: the sampled token is the best one
        assert logprob == pytest.approx(max(top.values())) and logprob <= 0
    assert lp["text_offset"][0] == 0
    assert all(b >= a for a, b in zip(lp["text_offset"], lp["text_offset"][1:], strict=False))


def test_chat_logprobs_shape(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                              "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert list(item) == ["token", "logprob", "bytes", "top_logprobs"]
        assert item["bytes"] == list(item["token"].encode("utf-8"))
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"])
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    plain = post(server, "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_echo(server):
    prompt = TINY_PROMPTS[0]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                         "echo": True, "logprobs": 1, "ignore_eos": True}).json()
    c = r["choices"][0]
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                             "temperature": 0, "ignore_eos": True}).json()
    assert c["text"] == prompt + plain["choices"][0]["text"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert len(c["logprobs"]["tokens"]) == n_prompt + 4
    assert c["logprobs"]["token_logprobs"][0] is None and c["logprobs"]["token_logprobs"][1] is not None
    _, raw = stream_raw(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0, "echo": True, "stream": True,
                                                    "ignore_eos": True})
    assert "".join(ch["choices"][0]["text"] for ch in sse_payloads(raw)) == c["text"]


def test_stop_string_and_seed_fields(server):
    base = {"model": MODEL, "prompt": TINY_PROMPTS[2], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    stop = text[3:6]
    r = post(server, "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]
    assert r["text"] == text[:text.find(stop)]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == stop
    _, raw = stream_raw(server, "/v1/completions", {**base, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_payloads(raw)) == r["text"]


def test_openai_client_completions(client):
    resp = client.completions.create(model=MODEL, prompt=TINY_PROMPTS[4], max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.usage.completion_tokens == len(
        client.completions.create(model=MODEL, prompt=TINY_PROMPTS[4], max_tokens=5, temperature=0,
                                  logprobs=0).choices[0].logprobs.tokens)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=TINY_PROMPTS[4], max_tokens=5, temperature=0, stream=True))
    assert streamed == resp.choices[0].text


def test_metrics_move(server):
    before = httpx.get(server.url + "/metrics").text
    post(server, "/v1/completions", {"model": MODEL, "prompt": TINY_PROMPTS[5], "max_tokens": 5,
                                     "temperature": 0, "ignore_eos": True})
    after = httpx.get(server.url + "/metrics").text
    from tests.server.conftest import parse_metric

    def delta(name, **labels):
        return parse_metric(after, name, **labels) - parse_metric(before, name, **labels)

    assert delta("chorus:generation_tokens_total") == 5
    assert delta("chorus:prompt_tokens_total") > 0
    assert delta("chorus:request_success_total", finished_reason="length") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens"):
        assert delta(f"chorus:{h}_count") == 1
    assert delta("chorus:inter_token_latency_seconds_count") >= 1
    assert delta("chorus:prefix_cache_queries_total") > 0
    assert delta("chorus:engine_steps_total") >= 5
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert parse_metric(after, f"chorus:{gauge}", model_name=MODEL) == 0


def test_chat_n_streams_every_choice(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "n": 2,
            "temperature": 0.8, "seed": 5, "ignore_eos": True}
    full = post(server, "/v1/chat/completions", body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1] and full["usage"]["completion_tokens"] == 8
    _, raw = stream_raw(server, "/v1/chat/completions", {**body, "stream": True})
    texts, finishes, roles = ["", ""], [None, None], [0, 0]
    for chunk in sse_payloads(raw):
        (c,) = chunk["choices"]
        roles[c["index"]] += c["delta"].get("role") == "assistant"
        texts[c["index"]] += c["delta"].get("content", "")
        finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    assert roles == [1, 1] and finishes == ["length", "length"]
    assert texts == [c["message"]["content"] for c in full["choices"]]  # same seed, same samples


def test_prompt_logprobs(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": TINY_PROMPTS[0], "max_tokens": 2,
                                         "prompt_logprobs": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == r["usage"]["prompt_tokens"] and plp[0] is None
    for step in plp[1:]:
        assert 1 <= len(step) <= 2
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in step.values())
