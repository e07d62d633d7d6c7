"""Adapters are read off the engine's step loop, and a refused request leaves no adapter behind.

The engine's client reads an adapter (disk, checks, conversion) on its own thread: the server in a
worker thread for /v1/load_lora_adapter and --lora-modules, the offline engine on the caller's thread
before the request reaches the core. The core only stores what it is sent; an adapter its host LRU
dropped, or one it was never sent, is read by its loader thread while the other requests run. A
slow disk (a reader that sleeps) therefore stalls no other stream and not /health.
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path

import httpx
import pytest
import torch

import lora.peft_adapter as peft_adapter
from engine.core_messages import AddRequest
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lora import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.security.health import HealthPoller
from tests.server.conftest import start_server

SLOW_S = 2.0
"""How long the patched reader sleeps per adapter."""
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("loading-adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return {name: build_peft_adapter(tiny_llama_dir, root / name, r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                     seed=seed, base_model=base) for seed, name in enumerate("abcd")}


class _Reads:
    """Wraps ``load_peft_adapter``: records each read (adapter name, thread, engine-core frames) and
    sleeps ``delay_s`` first."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.calls: list[tuple[str, str, bool]] = []
        self.started_s: list[float] = []
        """``time.monotonic()`` at each read's start."""
        self._real = peft_adapter.load_peft_adapter

    def __call__(self, name, *args, **kwargs):
        in_core = any(f.filename.endswith(("engine/engine_core.py", "engine/scheduler.py"))
                      for f in traceback.extract_stack())
        self.calls.append((name, threading.current_thread().name, in_core))
        self.started_s.append(time.monotonic())
        time.sleep(self.delay_s)
        return self._real(name, *args, **kwargs)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def _params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


# ------------------------------------------------------------------------------------------
# Offline engine
# ------------------------------------------------------------------------------------------
@pytest.fixture()
def engine(tiny_llama_dir):
    eng = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=128, enable_lora=True,
                                     max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    yield eng
    close = getattr(eng, "close", None)
    if close is not None:
        close()


def _loras(engine: LLMEngine) -> set[str]:
    return {r.lora_name for r in engine.list_loras()}


def test_first_use_reads_in_the_caller_once_and_an_evicted_one_in_the_loader(engine, adapter_dirs, monkeypatch):
    reads = _Reads()
    monkeypatch.setattr(peft_adapter, "load_peft_adapter", reads)
    lora_a = LoRARequest("a", 1, str(adapter_dirs["a"]))
    engine.add_request("a1", PROMPT, _params(), lora_request=lora_a)
    engine.add_request("a2", PROMPT, _params(), lora_request=lora_a)
    first = _run(engine)
    assert reads.names() == ["a"]                           # read once, for the first request
    assert first["a1"].outputs[0].token_ids == first["a2"].outputs[0].token_ids
    # The core keeps no reference to the weights beside its host store.
    assert all(r.adapter is None for r in engine.list_loras())
    lora_b = LoRARequest("b", 2, str(adapter_dirs["b"]))
    engine.add_lora(lora_b)                                  # max_cpu_loras=1: a leaves host memory
    engine.add_request("b1", PROMPT, _params(), lora_request=lora_b)
    _run(engine)                                             # max_loras=1: b takes a's slot
    assert engine.lora_manager.store.names() == ["b"] and reads.names() == ["a", "b"]
    assert engine.lora_manager.slot_of("a") is None
    engine.add_request("a3", PROMPT, _params(), lora_request=lora_a)
    again = _run(engine)
    assert again["a3"].outputs[0].token_ids == first["a1"].outputs[0].token_ids
    assert reads.names() == ["a", "b", "a"]
    threads = [c[1] for c in reads.calls]
    assert threads[:2] == [threading.current_thread().name] * 2 and threads[2] == "chorus-adapter-loader"
    assert not any(in_core for _, _, in_core in reads.calls), reads.calls   # never inside a step


def test_a_slow_reread_does_not_stall_the_other_requests(engine, adapter_dirs, monkeypatch):
    lora_a, lora_b = LoRARequest("a", 1, str(adapter_dirs["a"])), LoRARequest("b", 2, str(adapter_dirs["b"]))
    engine.add_lora(lora_a)
    engine.add_lora(lora_b)                                  # a is out of host memory
    reads = _Reads(delay_s=SLOW_S)
    monkeypatch.setattr(peft_adapter, "load_peft_adapter", reads)
    engine.add_request("base", PROMPT, _params(max_tokens=100))
    engine.add_request("a", PROMPT, _params(), lora_request=lora_a)
    step_s: list[float] = []
    base_tokens: list[tuple[float, int]] = []               # (time, base's output tokens) after each step
    done = {}
    t0 = time.monotonic()
    while engine.has_unfinished_requests():
        s = time.monotonic()
        outs = engine.step()
        step_s.append(time.monotonic() - s)
        done.update({o.request_id: o for o in outs if o.finished})
        base = engine.scheduler.requests.get("base")
        base_tokens.append((time.monotonic(), base.num_output_tokens if base is not None else 100))
    assert time.monotonic() - t0 >= SLOW_S * 0.9 and reads.names() == ["a"]
    assert max(step_s) < SLOW_S * 0.75, max(step_s)          # no step waited for the disk
    read_s = reads.started_s[0]
    while_reading = [n for t, n in base_tokens if read_s <= t <= read_s + SLOW_S * 0.9]
    assert while_reading and max(while_reading) - min(while_reading) >= 20   # the base request ran meanwhile
    assert len(done["a"].outputs[0].token_ids) == 6 and len(done["base"].outputs[0].token_ids) == 100


def test_a_request_refused_after_registration_rolls_it_back(engine, adapter_dirs, monkeypatch):
    reads = _Reads()
    monkeypatch.setattr(peft_adapter, "load_peft_adapter", reads)
    lora_c = LoRARequest("c", 3, str(adapter_dirs["c"]))
    real_add = engine.scheduler.add_request

    def refuse(request):
        raise ValueError("prompt: refused by a later check")

    monkeypatch.setattr(engine.scheduler, "add_request", refuse)
    with pytest.raises(ValueError, match="later check"):
        engine.add_request("c1", PROMPT, _params(), lora_request=lora_c)
    assert "c" not in _loras(engine) and "c" not in engine.lora_manager.store
    assert not engine.lora_manager.holds("c") and not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.scheduler, "add_request", real_add)
    # The client forgot it too: the next request carries the adapter again, and runs.
    engine.add_request("c2", PROMPT, _params(), lora_request=lora_c)
    assert len(_run(engine)["c2"].outputs[0].token_ids) == 6
    assert reads.names() == ["c", "c"] and "c" in _loras(engine)


def test_a_duplicate_id_sent_to_the_core_registers_nothing(engine, adapter_dirs):
    engine.add_request("dup", PROMPT, _params(max_tokens=50))
    lora_d = LoRARequest("d", 4, str(adapter_dirs["d"]))
    _, children = engine.processor.process("dup", PROMPT, _params(), lora_d)
    assert children[0].lora_request.adapter is not None      # carries the weights read by the client
    with pytest.raises(ValueError, match="already in use"):
        engine.core.add_request(AddRequest("dup", children))
    assert "d" not in _loras(engine) and not engine.lora_manager.holds("d")
    engine.abort_request(["dup"])


def test_a_stale_client_record_makes_the_loader_read_it(engine, adapter_dirs, monkeypatch):
    """The client believes the engine has the adapter (a request that carried it never arrived):
    the core reads it on its loader thread, and the request runs."""
    reads = _Reads()
    monkeypatch.setattr(peft_adapter, "load_peft_adapter", reads)
    lora_d = LoRARequest("d", 4, str(adapter_dirs["d"]))
    engine.processor.adapter_uploads.mark_sent(lora_d)
    engine.add_request("d1", PROMPT, _params(), lora_request=lora_d)
    assert len(_run(engine)["d1"].outputs[0].token_ids) == 6
    assert [(c[0], c[1]) for c in reads.calls] == [("d", "chorus-adapter-loader")]
    # A path that cannot be read fails its request with a 4xx error and unregisters it again.
    ghost = LoRARequest("ghost", 5, str(adapter_dirs["d"].parent / "no-such-adapter"))
    engine.processor.adapter_uploads.mark_sent(ghost)
    engine.add_request("g1", PROMPT, _params(), lora_request=ghost)
    outs = []
    while engine.has_unfinished_requests():
        try:
            outs += [o for o in engine.step() if o.finished]
        except ValueError as e:   # an LLMEngine.step that raises a failed request's error
            outs.append(e)
    assert len(outs) == 1
    error = outs[0] if isinstance(outs[0], Exception) else outs[0].error
    assert isinstance(error, ValueError) and "does not exist" in str(error)
    assert "ghost" not in _loras(engine)


# ------------------------------------------------------------------------------------------
# Server: a slow /v1/load_lora_adapter stalls no stream and not /health
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), engine_kwargs={"enable_lora": True, "max_lora_rank": 8},
                       served_model_name=["tiny"], max_model_len=256, allow_runtime_lora_updating=True)
    yield srv
    srv.stop()


def _stream_until(url: str, stop: threading.Event, stamps: list[list[float]]) -> None:
    """Stream base-model completions back to back until ``stop``; one list of chunk times per stream."""
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            times: list[float] = []
            stamps.append(times)
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        times.append(time.monotonic())
                    if stop.is_set():
                        break


def test_slow_runtime_load_does_not_stall_streams_or_health(server, adapter_dirs, monkeypatch):
    monkeypatch.setattr(peft_adapter, "load_peft_adapter", _Reads(delay_s=SLOW_S))
    stop = threading.Event()
    stamps: list[list[float]] = []
    stream = threading.Thread(target=_stream_until, args=(server.url, stop, stamps), daemon=True)
    stream.start()
    with HealthPoller(server, interval_s=0.1) as health:
        assert any(stamps) or _wait(lambda: any(stamps))        # a stream is producing tokens
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/load_lora_adapter",
                       json={"lora_name": "slow", "lora_path": str(adapter_dirs["a"])}, timeout=30)
        t1 = time.monotonic()
    stop.set()
    stream.join(30)
    assert r.status_code == 200, r.text
    assert t1 - t0 >= SLOW_S * 0.9
    during = [s for times in stamps for s in times if t0 + 0.1 < s < t1 - 0.1]
    assert len(during) >= 10, len(during)                   # tokens kept coming while the disk was slow
    gaps = [b - a for times in stamps for a, b in zip(times, times[1:]) if t0 - 0.5 < b < t1 + 0.5]
    assert gaps and max(gaps) < SLOW_S / 2, max(gaps)
    health.assert_answered_within(1.0, min_polls=3, since=t0, until=t1)
    out = httpx.post(server.url + "/v1/completions", json={"model": "slow", "prompt": PROMPT, "max_tokens": 3,
                                                           "ignore_eos": True}, timeout=30)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_runtime_load_through_an_engine_process(tiny_llama_dir, adapter_dirs):
    """The engine in a process of its own gets the adapter read by the API process (pickled)."""
    srv = start_server(str(tiny_llama_dir), engine_kwargs={"enable_lora": True, "max_lora_rank": 8},
                       served_model_name=["tiny"], max_model_len=128, allow_runtime_lora_updating=True,
                       engine_process=True)
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter_dirs["b"])},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        lora_out = httpx.post(srv.url + "/v1/completions", json={"model": "b", **body}, timeout=60)
        base_out = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
        assert lora_out.status_code == 200 and base_out.status_code == 200
        assert lora_out.json()["choices"][0]["text"] != base_out.json()["choices"][0]["text"]
    finally:
        srv.stop()
