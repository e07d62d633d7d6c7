"""Many concurrent streams are batched and correct; clients that go away get their requests aborted."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.conftest import TINY_PROMPTS
from tests.server.conftest import wait_until

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


def _idle_and_free(server) -> bool:
    s = server.engine_client.get_stats()
    return (s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0.0
            and server.metric("chorus:kv_cache_usage_perc") == 0.0
            and server.metric("chorus:num_requests_running") == 0.0)


async def _stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = "", None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def test_32_concurrent_streams_batched_and_right(server, tiny_llama_dir):
    prompts = [f"{TINY_PROMPTS[i % len(TINY_PROMPTS)]} {i}" for i in range(32)]
    lengths = [8 + (i % 5) for i in range(32)]
    steps_before = server.metric("chorus:engine_steps_total")

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*[_stream_one(client, p, n)
                                          for p, n in zip(prompts, lengths, strict=True)])

    results = asyncio.run(run_all())
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    ref = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                 for n in lengths], use_tqdm=False)
    assert [t for t, _ in results] == [o.outputs[0].text for o in ref]
    assert all(f == "length" for _, f in results)
    # Batched: some step ran many requests at once, and far fewer steps than 32 requests x ~10 tokens.
    assert server.metric("chorus:max_num_reqs_per_step") > 1
    assert server.engine_client.get_stats().max_reqs_per_step >= 8
    assert server.metric("chorus:engine_steps_total") - steps_before < sum(lengths) / 2
    assert wait_until(lambda: _idle_and_free(server))


def test_dropped_stream_is_aborted_and_blocks_freed(server):
    success_before = server.metric("chorus:request_success_total")
    body = {"model": MODEL, "prompt": TINY_PROMPTS[2], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                if got == 3:
                    break
            assert server.engine_client.get_stats().num_running_reqs == 1
    # Connection closed mid-stream: the engine must abort the request and free its blocks.
    assert wait_until(lambda: _idle_and_free(server), timeout_s=10)
    assert server.metric("chorus:request_success_total") == success_before  # aborted, never finished
    assert server.engine_client._states == {}


def test_dropped_non_streaming_request_is_aborted(server):
    success_before = server.metric("chorus:request_success_total")
    # 16 sequences of 240 tokens with logprobs (~0.3 s of work on a fast CPU); the client hangs up as soon as
    # the engine runs them, whatever the machine's speed.
    body = json.dumps({"model": MODEL, "prompt": TINY_PROMPTS[0], "max_tokens": 240, "temperature": 1.0,
                       "n": 16, "logprobs": 5, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: server.engine_client.get_stats().num_running_reqs > 0, timeout_s=10,
                          interval_s=0.01)
    assert wait_until(lambda: _idle_and_free(server), timeout_s=10)
    assert server.metric("chorus:request_success_total") == success_before
    # And the server keeps serving.
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "A", "max_tokens": 2})
    assert r.status_code == 200


def test_benchmark_script_against_server(server, tmp_path):
    """benchmarks/serve.py end to end (fixed concurrency, then Poisson arrivals) with JSON output."""
    from tests.benchmark_module import load_benchmark
    bench = load_benchmark("serve.py", "bench_serve")   # registered: dataclasses look their module up there
    out = tmp_path / "r.json"
    s = bench.main(["--base-url", server.url, "--num-prompts", "6", "--max-concurrency", "3",
                    "--input-len", "16", "--output-len", "5", "--out", str(out)])
    assert s["completed"] == 6 and s["failed"] == 0 and s["total_output_tokens"] == 30
    assert s["ttft_ms"]["mean"] > 0 and s["tpot_ms"]["p99"] > 0 and s["request_throughput"] > 0
    assert json.loads(out.read_text())["completed"] == 6
    s = bench.main(["--base-url", server.url, "--num-prompts", "4", "--request-rate", "50",
                    "--output-len", "3", "--endpoint", "/v1/chat/completions", "--model", MODEL,
                    "--num-warmups", "0"])
    assert s["completed"] == 4 and s["total_output_tokens"] == 12
