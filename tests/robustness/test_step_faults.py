"""A step that raises: its requests fail with a 500-class ``EngineStepError`` and the engine recovers
(their KV blocks, encoder entries and adapter slots freed, nothing left in the prefix cache), or, for a
CUDA error or ``MAX_CONSECUTIVE_STEP_FAULTS`` in a row, the engine stops (EngineDeadError, /health 503,
``chorus serve`` exits non-zero). Offline (``LLM``: the failed requests' outputs carry the error, finish
reason 'error'), through ``AsyncLLM`` and over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core_messages import GetStats
from engine.engine_core import MAX_CONSECUTIVE_STEP_FAULTS, _fatal_reason
from engine.errors import EngineDeadError, EngineStepError
from tests.server.conftest import start_server, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog wakes up and runs after the fox"
CUDA_FAULT = "CUDA error: an illegal memory access was encountered"


def _params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)


def _assert_failed(outputs, match: str) -> None:
    """Every output ended with an ``EngineStepError`` whose message matches ``match``."""
    assert outputs
    for out in outputs:
        assert out.finished and isinstance(out.error, EngineStepError), out
        assert re.search(match, str(out.error)), str(out.error)
        assert all(c.finish_reason == "error" for c in out.outputs)


def _assert_idle(core) -> None:
    stats = core.get_stats()
    assert not core.has_unfinished_requests()
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


# ------------------------------------------------------------------------------------------
# Offline
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=256)


def test_offline_fault_fails_the_step_and_the_engine_recovers_without_a_poisoned_prefix_cache(llm, monkeypatch):
    runner = llm.llm_engine.runner
    real_forward = runner._forward
    calls = []

    def failing_forward(*args, **kwargs):   # after the step's diff and inputs: the runner holds its rows
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom in the forward")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(runner, "_forward", failing_forward)
    _assert_failed(llm.generate([PROMPT, "Hello there"], _params(), use_tqdm=False),
                   "internal engine error occurred.*boom in the forward.*keeps serving")
    core = llm.llm_engine.core
    _assert_idle(core)
    # The failed prefill's blocks were hashed when allocated but never written: the same prompt now
    # must compute them again, not hit garbage KV in the prefix cache.
    after = llm.generate([PROMPT], _params(), use_tqdm=False)[0].outputs[0]
    assert llm.llm_engine.reset_prefix_cache()
    fresh = llm.generate([PROMPT], _params(), use_tqdm=False)[0].outputs[0]
    assert after.token_ids == fresh.token_ids
    assert after.cumulative_logprob == pytest.approx(fresh.cumulative_logprob, abs=1e-4)
    _assert_idle(core)


def test_offline_faults_in_a_row_stop_the_engine(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    core = llm.llm_engine.core
    core.inject_step_faults(RuntimeError("flaky device"), MAX_CONSECUTIVE_STEP_FAULTS)
    for _ in range(MAX_CONSECUTIVE_STEP_FAULTS - 1):
        _assert_failed(llm.generate(["Hi"], _params(), use_tqdm=False), "keeps serving")
    with pytest.raises(EngineDeadError, match=f"{MAX_CONSECUTIVE_STEP_FAULTS} steps failed in a row"):
        llm.generate(["Hi"], _params(), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        llm.generate(["Hi"], _params(), use_tqdm=False)


def test_offline_a_success_resets_the_count_and_a_cuda_error_is_fatal_at_once(llm):
    core = llm.llm_engine.core
    for _ in range(MAX_CONSECUTIVE_STEP_FAULTS + 1):   # each fault followed by a good step: never fatal
        core.inject_step_faults(RuntimeError("one-off"), 1)
        _assert_failed(llm.generate(["Hi"], _params(), use_tqdm=False), "one-off")
        assert len(llm.generate(["Hi"], _params(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    core.inject_step_faults(RuntimeError(CUDA_FAULT), 1)
    with pytest.raises(EngineDeadError, match="CUDA error leaves the device unusable"):
        llm.generate(["Hi"], _params(), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        llm.generate(["Hi"], _params(), use_tqdm=False)


ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)
"""torch's type of a CUDA runtime error (torch >= 2.8), None before."""
UNMARKED = "the accelerator stopped answering"
"""A message with none of the substrings the engine looks for in untyped errors."""


@pytest.mark.skipif(ACCELERATOR_ERROR is None, reason="torch < 2.8 has no torch.AcceleratorError")
def test_an_accelerator_error_is_fatal_by_its_type_whatever_its_message(tiny_llama_dir):
    class DeviceLost(ACCELERATOR_ERROR):
        """A subclass, as a backend may raise."""

    assert _fatal_reason(ACCELERATOR_ERROR(UNMARKED), 1) == "a CUDA error leaves the device unusable"
    assert _fatal_reason(DeviceLost(UNMARKED), 1) == "a CUDA error leaves the device unusable"
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    llm.llm_engine.core.inject_step_faults(ACCELERATOR_ERROR(UNMARKED), 1)
    with pytest.raises(EngineDeadError, match="CUDA error leaves the device unusable"):
        llm.generate(["Hi"], _params(), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        llm.generate(["Hi"], _params(), use_tqdm=False)


@pytest.mark.parametrize("error, fatal", [
    (RuntimeError(UNMARKED), False),
    (RuntimeError(CUDA_FAULT), True),                                     # torch < 2.8
    (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"), True),
    (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), True),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
])
def test_an_untyped_error_is_fatal_by_its_message_and_running_out_of_memory_is_not(error, fatal):
    assert (_fatal_reason(error, 1) is not None) is fatal
    assert _fatal_reason(error, MAX_CONSECUTIVE_STEP_FAULTS) is not None


def test_a_fault_while_loading_an_adapter_slot_frees_the_slot_for_a_clean_reload(tiny_llama_dir, tmp_path, monkeypatch):
    """The step fails half-way through copying an adapter into its slot: the slot must not be taken
    for loaded afterwards (the next request reloads it and matches a clean engine)."""
    from lora import LoRARequest
    from lora.manager import LoRAManager
    from tests.lora.utils import ALL_TARGETS, build_peft_adapter

    adapter = LoRARequest("a", 1, str(build_peft_adapter(tiny_llama_dir, tmp_path / "a", r=8, lora_alpha=16,
                                                         target_modules=ALL_TARGETS, seed=1)))
    llm = LLM(str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8)
    ref = llm.generate([PROMPT], _params(), lora_request=adapter, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.remove_lora("a")
    real_load = LoRAManager.load_slot

    def half_load(self, lora_slot, lora_request, pages=()):
        for layer in list(self.layers.values())[:2]:   # some layers get garbage, then the copy fails
            layer.lora_a[lora_slot].fill_(1.0)
        raise RuntimeError("copy failed half-way")

    monkeypatch.setattr(LoRAManager, "load_slot", half_load)
    _assert_failed(llm.generate([PROMPT], _params(), lora_request=adapter, use_tqdm=False), "copy failed half-way")
    assert llm.llm_engine.get_stats().num_active_loras == 0
    monkeypatch.setattr(LoRAManager, "load_slot", real_load)
    again = llm.generate([PROMPT], _params(), lora_request=adapter, use_tqdm=False)[0].outputs[0].token_ids
    assert again == ref
    _assert_idle(llm.llm_engine.core)


def test_a_fault_in_the_vision_encoder_leaves_no_encoder_cache_entry_behind(tmp_path, monkeypatch):
    """The encoder fails: the scheduler had counted the image as encoded; the next request with the
    same image must encode it again (not read a missing entry) and match a clean engine."""
    from tests.vision.conftest import build_tiny_llava, make_image

    llm = LLM(str(build_tiny_llava(tmp_path / "llava")), device="cpu", dtype="float32", max_model_len=256)
    prompt = {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(40, 30, 0)}}
    ref = llm.generate(prompt, _params(), use_tqdm=False)[0].outputs[0].token_ids
    core = llm.llm_engine.core
    assert llm.llm_engine.reset_prefix_cache()                     # the reference's KV and encoder
    core.scheduler.encoder_cache_manager.evict_unreferenced()     # entry: gone, so the image is encoded
    runner = llm.llm_engine.runner
    monkeypatch.setattr(runner.media, "encode",
                        lambda scheduled, requests: (_ for _ in ()).throw(RuntimeError("encoder")))
    _assert_failed(llm.generate(prompt, _params(), use_tqdm=False), "encoder")
    assert core.get_stats().encoder_cache_usage == 0.0
    monkeypatch.undo()
    assert llm.generate(prompt, _params(), use_tqdm=False)[0].outputs[0].token_ids == ref
    _assert_idle(core)


# ------------------------------------------------------------------------------------------
# AsyncLLM
# ------------------------------------------------------------------------------------------
def _async_llm(tiny_llama_dir):
    from engine.async_llm import AsyncLLM
    return AsyncLLM.from_engine_args(log_requests=False, model=str(tiny_llama_dir), max_model_len=256)


async def _drain(stream) -> list:
    return [out async for out in stream]


def test_async_fault_fails_running_requests_then_serves_new_ones(tiny_llama_dir):
    llm = _async_llm(tiny_llama_dir)

    async def go():
        streams = [await llm.add_request(PROMPT, _params(200), f"r{i}") for i in range(2)]
        await streams[0].__anext__()
        llm.inject_fault(RuntimeError("boom"), num_steps=1)
        for stream in streams:
            with pytest.raises(EngineStepError, match="internal engine error.*boom"):
                await _drain(stream)
        outs = await _drain(await llm.add_request(PROMPT, _params(5), "after"))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        while llm.get_stats().num_running_reqs or llm.get_stats().kv_cache_usage:
            await asyncio.sleep(0.01)
        return await llm.call_engine(GetStats())

    try:
        stats = asyncio.run(go())
        assert stats.kv_cache_usage == 0.0 and not llm.errored
        llm.check_health()
        assert llm._states == {} and not llm.output_processor.has_unfinished()
    finally:
        llm.shutdown()


def test_async_cuda_error_fails_the_step_with_500_then_the_engine_is_dead(tiny_llama_dir):
    llm = _async_llm(tiny_llama_dir)

    async def go():
        stream = await llm.add_request(PROMPT, _params(200), "r")
        await stream.__anext__()
        llm.inject_fault(RuntimeError(CUDA_FAULT), num_steps=1)
        with pytest.raises(EngineStepError, match="engine is stopping"):
            await _drain(stream)
        while not llm.errored:   # EngineDead follows the step's failures
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            await llm.add_request(PROMPT, _params(), "later")

    try:
        asyncio.run(go())
        assert llm.errored
        with pytest.raises(EngineDeadError):
            llm.check_health()
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny"], max_model_len=256)
    yield srv
    srv.stop()


def _complete(server, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=30)


def test_http_fault_gives_an_openai_500_and_the_server_keeps_serving(server):
    server.engine_client.inject_fault(RuntimeError("boom"), num_steps=1)
    r = _complete(server)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "InternalServerError" and err["code"] == 500
    assert "internal engine error occurred" in err["message"] and "boom" in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert _complete(server).status_code == 200


def test_http_fault_mid_stream_ends_it_with_an_in_band_500(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        server.engine_client.inject_fault(RuntimeError("boom"), num_steps=1)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
    assert errors and errors[0]["code"] == 500 and "internal engine error" in errors[0]["message"]
    assert _complete(server).status_code == 200
    assert wait_until(lambda: server.engine_client.get_stats().kv_cache_usage == 0.0)


def test_serve_exits_non_zero_after_a_fatal_fault(tiny_llama_dir, monkeypatch):
    """``run_server`` (what ``chorus serve`` runs): a CUDA error in a step gives that request its 500,
    then the server stops and raises SystemExit with a non-zero status."""
    from engine.async_llm import AsyncLLM
    from engine.server import app as app_module
    from engine.server.args import make_serve_namespace
    from tests.server.conftest import free_port

    real = AsyncLLM.from_engine_args.__func__

    def armed(cls, *args, **kwargs):
        client = real(cls, *args, **kwargs)
        client.inject_fault(RuntimeError(CUDA_FAULT), num_steps=1)
        return client

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(armed))
    port = free_port()
    args = make_serve_namespace(model_tag=str(tiny_llama_dir), served_model_name=["tiny"], max_model_len=256,
                                host="127.0.0.1", port=port, disable_log_requests=True,
                                uvicorn_log_level="warning", engine_process=False)
    url = f"http://127.0.0.1:{port}"
    seen: dict = {}

    def client() -> None:
        if wait_until(lambda: _up(url), timeout_s=60):
            seen["response"] = httpx.post(url + "/v1/completions", timeout=30,
                                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with pytest.raises(SystemExit) as exit_info:
        app_module.run_server(args)
    thread.join(30)
    assert exit_info.value.code not in (0, None)   # a message: the interpreter exits with status 1
    assert "engine died" in str(exit_info.value.code)
    r = seen["response"]
    assert r.status_code == 500 and "engine is stopping" in r.json()["error"]["message"]


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
