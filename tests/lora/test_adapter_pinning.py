"""On a CUDA engine the host store keeps page-locked adapters; the weights a client sends are pinned by the
loader thread, never on the step loop, and the adapter's requests wait for it as for a disk read."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import LoRAConfig
from lora import LoRARequest
from lora.manager import LoRAManager
from lora.peft_adapter import LoRAAdapter
from tests.lora.test_manager import _model
from tests.lora.utils import ALL_TARGETS, build_peft_adapter


@pytest.fixture
def pinning(monkeypatch):
    """Records the thread of every ``LoRAAdapter.pin_memory`` (CPU tensors cannot be page-locked here)."""
    threads: list[str] = []
    pinned: set[int] = set()

    def pin(adapter):
        threads.append(threading.current_thread().name)
        pinned.add(id(adapter))
        return adapter

    monkeypatch.setattr(LoRAAdapter, "pin_memory", pin)
    monkeypatch.setattr(LoRAAdapter, "is_pinned", lambda adapter: id(adapter) in pinned)
    return threads


def _manager(tiny_llama_dir) -> LoRAManager:
    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4), _model(tiny_llama_dir),
                      torch.device("cpu"), torch.float32)
    mgr.loader.pin_memory = mgr.store.pin_memory = True     # as on a CUDA engine
    return mgr


def test_sent_weights_are_pinned_off_the_step_loop(tiny_llama_dir, tmp_path, pinning):
    path = build_peft_adapter(tiny_llama_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=ALL_TARGETS, seed=0)
    mgr = _manager(tiny_llama_dir)
    request = LoRARequest("a", 1, str(path))
    sent = request.with_adapter(mgr.reader.read(request))          # what the client read and sent
    assert mgr.register(sent, read_later=True)
    assert "a" not in mgr.store and not mgr.host_ready(request)    # its requests wait meanwhile
    for _ in range(200):
        mgr.loader.wait(0.05)
        if not mgr.take_reads() and "a" in mgr.store:
            break
    assert mgr.host_ready(request) and mgr.store.get("a") is sent.adapter
    assert pinning and all(name == "chorus-adapter-loader" for name in pinning), pinning
    assert [r.lora_name for r in mgr.list_loras()] == ["a"] and mgr.list_loras()[0].adapter is None


def test_sent_again_after_eviction_is_pinned_off_the_loop(tiny_llama_dir, tmp_path, pinning):
    path = build_peft_adapter(tiny_llama_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"], seed=0)
    mgr = _manager(tiny_llama_dir)
    request = LoRARequest("a", 1, str(path))
    mgr.register(request)                                          # read and pinned here (a direct caller)
    assert mgr.store.remove("a")                                  # evicted from host memory
    pinning.clear()
    assert not mgr.register(request.with_adapter(mgr.reader.read(request)), read_later=True)
    assert "a" not in mgr.store
    for _ in range(200):
        mgr.loader.wait(0.05)
        mgr.take_reads()
        if "a" in mgr.store:
            break
    assert "a" in mgr.store and pinning == ["chorus-adapter-loader"]


def test_without_pinning_sent_weights_go_straight_to_the_store(tiny_llama_dir, tmp_path, pinning):
    path = build_peft_adapter(tiny_llama_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"], seed=0)
    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), _model(tiny_llama_dir),
                      torch.device("cpu"), torch.float32)
    request = LoRARequest("a", 1, str(path))
    assert mgr.register(request.with_adapter(mgr.reader.read(request)), read_later=True)
    assert "a" in mgr.store and not mgr.loader.busy and not pinning
