"""Adapters whose files go bad after registration, and adapter files that try to run code.

A registered adapter the host LRU dropped (``max_cpu_loras``) is read again from disk (by the engine's
loader thread, off the step loop) when a waiting request needs it in a slot; if its directory was deleted or its weights corrupted meanwhile, the requests
naming it fail with a 4xx that names the adapter (404 missing, 400 corrupt), the other requests of
the step run on, and nothing leaks (its slot is free, KV blocks freed). A pickle in
``adapter_model.bin`` is never executed (``torch.load(weights_only=True)``): a 400 at load.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from engine.core_messages import GetStats
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lora import LoRARequest
from lora.errors import InvalidLoRAAdapterError, LoRAAdapterNotFoundError
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.server.conftest import start_server

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapter_src(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fault-adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return {name: build_peft_adapter(tiny_llama_dir, root / name, r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                     seed=seed, base_model=base) for seed, name in enumerate(["a", "b"])}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


class _Evil:
    """Unpickling this runs ``os.mkdir(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _evil_adapter(good: Path, dst: Path, torch_zip: bool) -> Path:
    """A valid adapter_config.json next to an adapter_model.bin that is a code-running pickle."""
    dst.mkdir()
    shutil.copy(good / "adapter_config.json", dst / "adapter_config.json")
    marker = dst / "pwned"
    if torch_zip:
        torch.save({"base_model.model.x.lora_A.weight": _Evil(marker)}, dst / "adapter_model.bin")
    else:
        (dst / "adapter_model.bin").write_bytes(pickle.dumps({"w": _Evil(marker)}))
    return dst


# ------------------------------------------------------------------------------------------
# Offline
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True,
                                      max_loras=1, max_cpu_loras=1, max_lora_rank=8)


def _run(engine: LLMEngine) -> tuple[dict, list]:
    """Step until idle; returns the finished outputs without an error by request id, and the errors
    of those the engine failed (their final outputs carry them, finish reason 'error')."""
    done, errors = {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.error is not None:
                assert o.finished and [c.finish_reason for c in o.outputs] == ["error"]
                errors.append(o.error)
            elif o.finished:
                done[o.request_id] = o
    return done, errors


def _base_reference(engine: LLMEngine) -> list[int]:
    engine.add_request("ref", PROMPT, _params())
    return _run(engine)[0]["ref"].outputs[0].token_ids


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_offline_damaged_adapter_fails_its_request_and_the_step_goes_on(engine, adapter_src, tmp_path, damage):
    ref = _base_reference(engine)
    a = _copy(adapter_src["a"], tmp_path / "a")
    lora_a, lora_b = LoRARequest(f"a-{damage}", 1, str(a)), LoRARequest(f"b-{damage}", 2, str(adapter_src["b"]))
    engine.add_lora(lora_a)
    engine.add_lora(lora_b)                       # max_cpu_loras=1: a's host copy is dropped
    assert engine.lora_manager.store.names() == [lora_b.lora_name]
    if damage == "deleted":
        shutil.rmtree(a)
    else:
        weights = a / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    engine.add_request("lora", PROMPT, _params(), lora_request=lora_a)
    engine.add_request("base", PROMPT, _params())
    done, errors = _run(engine)
    expected = LoRAAdapterNotFoundError if damage == "deleted" else InvalidLoRAAdapterError
    assert len(errors) == 1 and type(errors[0]) is expected
    message = str(errors[0])
    assert repr(lora_a.lora_name) in message and "could not be read again" in message and "Restore" in message
    assert list(done) == ["base"] and done["base"].outputs[0].token_ids == ref   # same step, unharmed
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_active_loras == 0          # its slot is free
    engine.add_request("b", PROMPT, _params(), lora_request=lora_b)             # the one slot serves b
    assert len(_run(engine)[0]["b"].outputs[0].token_ids) == 6
    # Restored files: the adapter works again, reloaded from disk (nothing stale kept).
    if damage == "deleted":
        _copy(adapter_src["a"], a)
    else:
        shutil.copy(adapter_src["a"] / "adapter_model.safetensors", a / "adapter_model.safetensors")
    engine.add_request("again", PROMPT, _params(), lora_request=lora_a)
    assert len(_run(engine)[0]["again"].outputs[0].token_ids) == 6
    for lora in (lora_a, lora_b):
        engine.remove_lora(lora.lora_name)


def test_offline_failed_host_copy_fails_its_requests_and_leaves_every_step_message_as_scheduled(
        engine, adapter_src, monkeypatch):
    """The host copy of an adapter the LRU dropped cannot be made (its read raises): only its request
    fails, with the 4xx, the base request beside it runs, and every ``SchedulerOutput`` the scheduler
    returned is frozen and unchanged once its step ran (none loads the failed adapter: the scheduler
    loads only adapters in host memory)."""
    ref = _base_reference(engine)
    lora_a = LoRARequest("a-host", 3, str(adapter_src["a"]))
    lora_b = LoRARequest("b-host", 4, str(adapter_src["b"]))
    engine.add_lora(lora_a)
    engine.add_lora(lora_b)                       # max_cpu_loras=1: a's host copy is dropped
    loader, schedule = engine.lora_manager.loader, engine.scheduler.schedule
    read = loader.reader.read

    def failing_read(lora_request: LoRARequest):
        if lora_request.lora_name == lora_a.lora_name:
            raise LoRAAdapterNotFoundError("the host copy cannot be made")
        return read(lora_request)

    scheduled = []

    def recording_schedule():
        so = schedule()
        scheduled.append((so, copy.deepcopy(so)))
        return so

    monkeypatch.setattr(loader, "reader", SimpleNamespace(read=failing_read))
    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    engine.add_request("lora", PROMPT, _params(), lora_request=lora_a)
    engine.add_request("base", PROMPT, _params())
    done, errors = _run(engine)
    assert len(errors) == 1 and type(errors[0]) is LoRAAdapterNotFoundError and "'a-host'" in str(errors[0])
    assert list(done) == ["base"] and done["base"].outputs[0].token_ids == ref
    assert scheduled and all(so == snapshot for so, snapshot in scheduled)
    assert all(load.lora_request != lora_a for so, _ in scheduled for load in so.lora_loads)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheduled[0][0].lora_loads = ()
    monkeypatch.undo()
    for lora in (lora_a, lora_b):
        engine.remove_lora(lora.lora_name)


@pytest.mark.parametrize("torch_zip", [False, True], ids=["raw-pickle", "torch-save"])
def test_offline_pickle_in_adapter_bin_is_refused_not_run(engine, adapter_src, tmp_path, torch_zip):
    evil = _evil_adapter(adapter_src["a"], tmp_path / "evil", torch_zip)
    with pytest.raises(InvalidLoRAAdapterError, match="adapter_model.bin is not a valid weights file"):
        engine.add_lora(LoRARequest("evil", 9, str(evil)))
    with pytest.raises(InvalidLoRAAdapterError):   # first use by a request: refused the same way
        engine.add_request("evil-req", PROMPT, _params(), lora_request=LoRARequest("evil", 9, str(evil)))
    assert not (evil / "pwned").exists()
    assert not engine.has_unfinished_requests()


def test_every_torch_load_is_weights_only():
    """No torch.load in the product may unpickle arbitrary objects (adapters and checkpoints come
    from users)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    calls = []
    for pkg in ("engine", "lora", "multimodal", "encoders", "kernels"):
        for path in (root / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                    weights_only = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                    calls.append((f"{path.name}:{node.lineno}",
                                  isinstance(weights_only, ast.Constant) and weights_only.value is True))
    assert len(calls) >= 2, calls   # the adapter and checkpoint loaders
    assert all(ok for _, ok in calls), calls


# ------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_dirs(adapter_src, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-adapters")
    return {name: _copy(adapter_src[src], root / name) for name, src in
            [("gone", "a"), ("broken", "a"), ("b", "b")]}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapter_dirs):
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny"], max_model_len=256,
                       lora_modules=[f"{n}={p}" for n, p in adapter_dirs.items()],
                       allow_runtime_lora_updating=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    yield srv
    srv.stop()


async def _together(url: str, models: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await asyncio.gather(*[client.post("/v1/completions", json={
            "model": m, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}) for m in models])


@pytest.mark.parametrize("name, status", [("gone", 404), ("broken", 400)])
def test_http_damaged_adapter_gives_4xx_and_the_base_request_beside_it_succeeds(server, adapter_dirs, name, status):
    path = adapter_dirs[name]
    if name == "gone":
        shutil.rmtree(path)
    else:
        (path / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    # Start-up registered gone, broken, b in that order: with max_cpu_loras=1 only b is in host memory.
    bad, base = asyncio.run(_together(server.url, [name, "tiny"]))
    assert bad.status_code == status, bad.text
    err = bad.json()["error"]
    assert err["code"] == status and repr(name) in err["message"] and "could not be read again" in err["message"]
    assert base.status_code == 200 and base.json()["usage"]["completion_tokens"] == 6
    stats = server.call_engine(GetStats())
    # Its request waited for the read without a slot, and no slot is held for it.
    assert stats.kv_cache_usage == 0.0 and stats.num_lora_slots_in_use == 0
    ok = asyncio.run(_together(server.url, ["b"]))[0]
    assert ok.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_http_load_lora_adapter_refuses_a_pickle(server, adapter_src, tmp_path):
    evil = _evil_adapter(adapter_src["a"], tmp_path / "evil", torch_zip=True)
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(evil)})
    # One message for every runtime load failure (nothing of the file reaches the client).
    assert r.status_code == 400 and "could not be loaded from lora_path" in r.json()["error"]["message"]
    assert not (evil / "pwned").exists()
