"""``--engine-process``: the engine loop in a child process behind the same HTTP API.

Same outputs as the in-process (thread) engine, requests validated in the API process, aborts
that free the child's KV blocks, LoRA load/unload by method name, stats for /metrics, engine death
(a killed child) turned into 503s, and shutdown that stops the child.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.core_messages import AddLoRA
from engine.core_transport import ProcessTransport, ThreadTransport
from lora import LoRAAdapterNotFoundError, LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.server.conftest import start_server, wait_until

PROMPTS = ["def add(a, b):", "The quick brown fox", "Paged attention keeps"]


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory):
    return build_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("ep-adapter") / "sql", r=8, lora_alpha=16,
                              target_modules=ALL_TARGETS, seed=1)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    common = dict(served_model_name=["tiny-llama"], max_model_len=256, enable_lora=True,
                  allow_runtime_lora_updating=True, max_loras=2)
    proc = start_server(str(tiny_llama_dir), engine_process=True, **common)
    thread = start_server(str(tiny_llama_dir), engine_process=False, **common)
    yield proc, thread
    thread.stop()
    child = proc.engine_client._transport.proc
    proc.stop()
    proc.engine_client.shutdown()
    assert wait_until(lambda: not child.is_alive())   # shutdown stops the engine process


def _complete(url: str, prompt: str, model: str = "tiny-llama") -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_outputs_as_the_thread_engine(servers):
    proc, thread = servers
    assert isinstance(proc.engine_client._transport, ProcessTransport)
    assert isinstance(thread.engine_client._transport, ThreadTransport)
    for prompt in PROMPTS:
        a, b = _complete(proc.url, prompt), _complete(thread.url, prompt)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["choices"][0]["logprobs"]["top_logprobs"] == b["choices"][0]["logprobs"]["top_logprobs"]
        assert a["usage"] == b["usage"]
    # n > 1 and streaming through the pipe.
    client = openai.OpenAI(base_url=proc.base_url, api_key="x", max_retries=0)
    out = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=6, n=2, temperature=0)
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text
    chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _complete(proc.url, PROMPTS[0])["choices"][0]["text"]


def test_validation_happens_in_the_api_process(servers):
    proc, _ = servers
    r = httpx.post(proc.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(proc.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


def test_disconnect_aborts_and_frees_blocks_in_the_child(servers):
    proc, _ = servers
    with httpx.stream("POST", proc.url + "/v1/completions",
                      json={"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 200, "stream": True,
                            "ignore_eos": True}, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 3:
                break
    stats = proc.engine_client.get_stats
    assert wait_until(lambda: stats().num_running_reqs == 0 and stats().kv_cache_usage == 0.0)
    assert proc.metric("chorus:num_requests_running") == 0


def test_lora_load_and_unload_by_method_name(servers, adapter):
    proc, thread = servers
    for srv in (proc, thread):
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
    assert _complete(proc.url, PROMPTS[0], model="sql")["choices"][0]["text"] == \
        _complete(thread.url, PROMPTS[0], model="sql")["choices"][0]["text"]
    r = httpx.post(proc.url + "/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": "/no/such/dir"})
    assert r.status_code == 400 and "could not be loaded from lora_path" in r.json()["error"]["message"]
    with pytest.raises(LoRAAdapterNotFoundError):   # the child's own error crosses the pipe intact
        proc.call_engine(AddLoRA(LoRARequest("ghost", 99, "/no/such/dir")))
    for srv in (proc, thread):
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    r = httpx.post(proc.url + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404


def test_killed_engine_process_gives_503_and_shutdown_stops_it(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=128, engine_process=True)
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        proc = srv.engine_client._transport.proc
        proc.kill()
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503)
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    finally:
        srv.stop()
    # That shutdown stops a live engine process: the ``servers`` fixture's teardown checks it.


def test_a_step_fault_in_the_engine_process_is_a_500_and_the_engine_goes_on(servers):
    """A step that raises in the child: its request's EngineStepError crosses the pipe (a 500), the
    engine keeps serving (README, "Failure behaviour")."""
    proc, _ = servers
    proc.engine_client.inject_fault(RuntimeError("boom in the child"), num_steps=1)
    r = httpx.post(proc.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "A", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 500 and "boom in the child" in r.json()["error"]["message"], r.text
    assert httpx.get(proc.url + "/health").status_code == 200
    _complete(proc.url, PROMPTS[0])


def test_fault_in_the_engine_process_ends_streams_with_503(tiny_llama_dir):
    """The child's loop dies of an exception: its EngineDead crosses the pipe; the in-flight stream
    ends with an in-band 503 event and [DONE], then /health and new requests get 503."""
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=128, engine_process=True)
    try:
        body = {"model": "tiny-llama", "prompt": "A", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            srv.engine_client.inject_fault()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and any('"code":503' in line for line in rest), rest[-3:]
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503)
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        srv.stop()
