"""How an adapter's weights travel from its directory to the engine: the scale folded in one pass with the
float32 path's values; a client in another process checks the adapter from its header and sends no weights
(the engine reads them on its loader threads, several adapters at once, never on the step loop); the
server resolves different adapter names at once."""

from __future__ import annotations

import asyncio
import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core_messages import AddLoRA
from engine.server.serving_models import OpenAIServingModels
from lora import peft_adapter
from lora.adapter_loader import AdapterLoader
from lora.adapter_reader import AdapterReader
from lora.adapter_uploads import AdapterUploads
from lora.errors import InvalidLoRAAdapterError
from lora.peft_adapter import LoRATargets, _scaled
from lora.request import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoConfig

    from engine.models.llama import LlamaForCausalLM

    root = tmp_path_factory.mktemp("adapter-transfer")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    reader = AdapterReader(LoRATargets.from_model(LlamaForCausalLM(config, 512)), 16, torch.float32)
    good = build_peft_adapter(tiny_llama_dir, root / "good", r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                              seed=0)
    return root, reader, good


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                     (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
                                     (torch.float32, torch.float32)])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0 / 3.0])
def test_scale_folding_equals_the_float32_path(src, dst, scale):
    b = (torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 3).to(src).t()   # not contiguous
    want = (b.to(torch.float32) * scale).to(dst).contiguous()
    got = _scaled(b, scale, dst)
    assert got.dtype == dst and got.is_contiguous() and torch.equal(got, want)


def test_check_reads_no_weights_and_fails_as_the_read_does(setup, tmp_path, monkeypatch):
    root, reader, good = setup
    lora = LoRARequest("good", 1, str(good))
    read, checked = reader.read(lora), reader.check(lora)
    assert checked.rank == read.rank == 8 and checked.adapts_encoder == read.adapts_encoder
    assert checked.weights.keys() == read.weights.keys()
    for key, w in read.weights.items():
        c = checked.weights[key]
        assert c.lora_a.is_meta and c.lora_b.is_meta
        assert (c.lora_a.shape, c.lora_b.shape, c.lora_b.dtype) == (w.lora_a.shape, w.lora_b.shape, w.lora_b.dtype)
    pre = "base_model.model.model.layers.0."
    broken = {
        "rank-mismatch": lambda t: {**t, pre + "self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)},
        "half-pair": lambda t: {k: v for k, v in t.items() if "0.self_attn.q_proj.lora_B" not in k},
        "over-rank": lambda t: {k: (torch.zeros(32, v.shape[1]) if "0.self_attn.o_proj.lora_A" in k else
                                    torch.zeros(v.shape[0], 32) if "0.self_attn.o_proj.lora_B" in k else v)
                                for k, v in t.items()},
    }
    for name, edit in broken.items():
        path = Path(shutil.copytree(good, tmp_path / name))
        f = path / "adapter_model.safetensors"
        save_file(edit(load_file(str(f))), str(f))
        bad = LoRARequest(name, 2, str(path))
        with pytest.raises(InvalidLoRAAdapterError) as by_read:
            reader.read(bad)
        with pytest.raises(InvalidLoRAAdapterError) as by_check:
            reader.check(bad)
        assert str(by_check.value) == str(by_read.value), name
    truncated = Path(shutil.copytree(good, tmp_path / "truncated"))
    f = truncated / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(InvalidLoRAAdapterError, match="not a valid weights file"):
        reader.check(LoRARequest("truncated", 3, str(truncated)))
    # The check reads the header only: no tensor of the file is loaded.
    monkeypatch.setattr("safetensors.torch.load_file", lambda *a, **k: pytest.fail("weights were read"))
    reader.check(lora)


def test_a_client_in_another_process_sends_names_and_paths(setup):
    _, reader, good = setup
    here = AdapterUploads(reader)
    lora = LoRARequest("good", 1, str(good))
    assert here.ship_weights and here.attach(lora).adapter is not None
    there = pickle.loads(pickle.dumps(here))            # what an engine process's client holds
    assert not there.ship_weights and not there.was_sent(lora)
    sent = there.attach(lora)
    assert sent.adapter is None and sent.lora_path == lora.lora_path and there.was_sent(lora)
    assert there.adapts_encoder(lora) is False           # known from the check


class _GatedReads:
    """A reader whose first ``parties`` reads each wait until all of them run at once (or time out); it
    records the most reads that ran at once."""

    def __init__(self, reader: AdapterReader, parties: int) -> None:
        self.reader, self.parties = reader, parties
        self.barrier = threading.Barrier(parties, timeout=5)
        self.count = self.active = self.most = 0
        self.lock = threading.Lock()

    def read(self, lora_request, pin_memory=False):
        with self.lock:
            self.count += 1
            self.active += 1
            self.most = max(self.most, self.active)
            gated = self.count <= self.parties
        try:
            if gated:
                self.barrier.wait()                        # BrokenBarrierError when reads run one at a time
            return self.reader.read(lora_request, pin_memory)
        finally:
            with self.lock:
                self.active -= 1


def test_the_loader_reads_several_adapters_at_once(setup):
    _, reader, good = setup
    gated = _GatedReads(reader, parties=3)
    loader = AdapterLoader(gated, num_threads=3)
    for i in range(4):
        loader.request(LoRARequest(f"a{i}", i + 1, str(good)))
    deadline = time.monotonic() + 20
    done = []
    while len(done) < 4 and time.monotonic() < deadline:
        loader.wait(0.5)
        done += loader.take_done()
    assert sorted(d.lora_request.lora_name for d in done) == ["a0", "a1", "a2", "a3"]
    assert all(d.result.rank == 8 for d in done), [d.result for d in done]   # the first three met at once
    assert gated.most == 3 and not loader.busy                # never more than num_threads
    with pytest.raises(ValueError, match="num_threads >= 1"):
        AdapterLoader(reader, num_threads=0)


class _SlowEngine:
    """An engine client whose ``AddLoRA`` answers after ``delay_s``, recording how many were in flight."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.in_flight, self.most = delay_s, 0, 0

    async def call_engine(self, call):
        assert isinstance(call, AddLoRA)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return True


class _DirResolver:
    def __init__(self, path: str) -> None:
        self.path = path

    def resolve(self, name: str):
        return self.path if name.startswith("ad") else None

    def list_names(self):
        return []


def test_the_server_resolves_different_names_at_once_and_one_name_once(setup):
    _, _, good = setup
    engine = _SlowEngine(delay_s=0.3)
    models = OpenAIServingModels(engine, ["base"], "base", lora_resolvers=[_DirResolver(str(good))])

    async def burst():
        names = [f"ad{i % 4}" for i in range(12)]
        return await asyncio.gather(*(models.resolve_lora_by_name(n) for n in names))

    t0 = time.monotonic()
    got = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    assert engine.most == 4 and elapsed < 4 * 0.3            # four names at once, not one after another
    assert len({id(g) for g in got}) == 4 and sorted(models.lora_requests) == ["ad0", "ad1", "ad2", "ad3"]
    assert not models._name_locks                           # no lock kept once nobody waits


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("pin", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_safetensors_read_into_one_buffer_equals_safetensors(setup, pin):
    if pin and not torch.cuda.is_available():
        pytest.skip("page-locked memory needs CUDA")
    _, reader, good = setup
    f = good / "adapter_model.safetensors"
    want = load_file(str(f))
    got = peft_adapter.read_adapter_tensors(good, pin_memory=pin)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v) and (not pin or got[k].is_pinned())
    assert len({_storage(t) for t in got.values()}) == 1                     # views of one buffer
    adapter = reader.read(LoRARequest("good", 1, str(good)), pin_memory=pin)
    assert not pin or (adapter.is_pinned() and adapter.pin_memory() is adapter)
    assert len({_storage(t) for w in adapter.weights.values() for t in (w.lora_a, w.lora_b)}) == 1


def test_safetensors_reads_that_one_buffer_cannot_hold(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    tensors = {"a": torch.arange(3, dtype=torch.float16), "b": torch.arange(5, dtype=torch.float32)}
    save_file(tensors, str(mixed / "adapter_model.safetensors"))      # b starts 6 bytes in: not aligned
    got = peft_adapter.read_adapter_tensors(mixed)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    bad = tmp_path / "bad"
    bad.mkdir()
    f = bad / "adapter_model.safetensors"
    save_file({"a": torch.ones(4)}, str(f))
    raw = f.read_bytes()
    f.write_bytes(raw.replace(b"[0,16]", b"[0,99]"))                       # past the file's end
    with pytest.raises(InvalidLoRAAdapterError, match="offsets 0..99 do not fit"):
        peft_adapter.read_adapter_tensors(bad)
