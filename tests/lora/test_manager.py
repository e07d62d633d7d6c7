"""Host store LRU, LoRAManager slots and removal, and the engine's add/remove/list_loras."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import LoRAConfig
from engine.kernel_policy import KernelPolicy
from lora import LoRARequest
from lora.adapter_store import AdapterStore
from lora.errors import InvalidLoRAAdapterError, LoRAAdapterNotFoundError
from lora.manager import LoRAManager
from lora.peft_adapter import LoRAAdapter, LoRASliceWeights, PEFTAdapterConfig
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, edit_adapter_config


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mgr-adapters")
    specs = [(4, ALL_TARGETS), (8, ["q_proj", "v_proj"]), (8, ["down_proj"])]
    return [build_peft_adapter(tiny_llama_dir, root / f"a{i}", r=r, lora_alpha=2 * r, target_modules=t,
                               seed=i) for i, (r, t) in enumerate(specs)]


def _model(tiny_llama_dir):
    from transformers import AutoConfig

    from engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(AutoConfig.from_pretrained(tiny_llama_dir), 512)


def _req(i, path):
    return LoRARequest(f"a{i}", i + 1, str(path))


def _fake_adapter(name):
    w = LoRASliceWeights(torch.zeros(2, 3), torch.zeros(4, 2))
    return LoRAAdapter(name, "/x", 2, PEFTAdapterConfig(r=2, lora_alpha=2), {("m", 0): w})


def test_store_lru_evicts_least_recently_used():
    store = AdapterStore(2)
    assert store.put(_fake_adapter("a")) == [] and store.put(_fake_adapter("b")) == []
    store.get("a")                                   # a is now the most recent
    assert store.put(_fake_adapter("c")) == ["b"]
    assert store.names() == ["a", "c"] and "b" not in store
    assert store.remove("a") and not store.remove("a")
    assert store.nbytes() == (6 + 8) * 4
    with pytest.raises(ValueError):
        AdapterStore(0)


def test_manager_wraps_every_projection(tiny_llama_dir):
    model = _model(tiny_llama_dir)
    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), model, torch.device("cpu"), torch.float32)
    assert len(mgr.layers) == 8
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.adapter is mgr.layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv.adapter.lora_a.shape == (3, 2, 8, 64)
    assert mgr.slot_nbytes() > 0 and mgr.backend == "torch"


def test_register_reload_after_eviction(tiny_llama_dir, adapters):
    mgr = LoRAManager(LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=2), _model(tiny_llama_dir),
                      torch.device("cpu"), torch.float32)
    reqs = [_req(i, p) for i, p in enumerate(adapters)]
    for r in reqs:
        mgr.register(r)
    assert mgr.store.names() == ["a1", "a2"] and mgr.store.num_evictions == 1
    assert [r.lora_name for r in mgr.list_loras()] == ["a0", "a1", "a2"]   # still registered
    mgr.register(reqs[0])                      # known name: no reload at registration
    assert mgr.store.num_loads == 3
    mgr.load_slot(0, reqs[0])                  # needs its weights: reloaded from disk
    assert mgr.store.num_loads == 4 and "a0" in mgr.store and mgr.slot_of("a0") == 0
    layer = mgr.layers["model.layers.1.mlp.down_proj"]
    w = mgr.store.get("a0").weights[("model.layers.1.mlp.down_proj", 0)]
    torch.testing.assert_close(layer.lora_a[0, 0, :4], w.lora_a)
    mgr.load_slot(0, reqs[2])                  # a2 only targets down_proj: q/k/v slices zeroed
    assert mgr.layers["model.layers.0.self_attn.qkv_proj"].lora_a[:, 0].abs().sum() == 0
    assert mgr.slot_of("a0") is None and mgr.slot_of("a2") == 0


def test_register_errors(tiny_llama_dir, adapters, tmp_path):
    mgr = LoRAManager(LoRAConfig(max_loras=1, max_lora_rank=4), _model(tiny_llama_dir),
                      torch.device("cpu"), torch.float32)
    with pytest.raises(InvalidLoRAAdapterError, match="greater than max_lora_rank 4"):
        mgr.register(_req(1, adapters[1]))
    with pytest.raises(LoRAAdapterNotFoundError):
        mgr.register(LoRARequest("ghost", 9, str(tmp_path / "missing")))
    mgr.register(_req(0, adapters[0]))
    with pytest.raises(InvalidLoRAAdapterError, match="already loaded from"):
        mgr.register(LoRARequest("a0", 1, str(adapters[2])))
    assert [r.lora_name for r in mgr.list_loras()] == ["a0"]


def test_remove_frees_host_copy_and_slot(tiny_llama_dir, adapters):
    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), _model(tiny_llama_dir),
                      torch.device("cpu"), torch.float32)
    r0, r1 = _req(0, adapters[0]), _req(1, adapters[1])
    mgr.register(r0)
    mgr.register(r1)
    mgr.load_slot(0, r0)
    mgr.load_slot(1, r1)
    refs = [weakref.ref(w.lora_a) for w in mgr.store.get("a0").weights.values()]
    assert mgr.remove("a0")
    gc.collect()
    assert all(r() is None for r in refs), "a tensor of the removed adapter is still referenced"
    assert not mgr.holds("a0") and "a0" not in mgr.store and mgr.slot_of("a0") is None
    for layer in mgr.layers.values():
        assert layer.lora_a[:, 0].abs().sum() == 0 and all(b[0].abs().sum() == 0 for b in layer.lora_b)
    qkv = mgr.layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv.lora_a[0, 1].abs().sum() > 0                      # the other adapter's slot is intact
    assert not mgr.remove("a0")


# ------------------------------------------------------------------------------------------ engine
def _params(n=8):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_engine_remove_waits_for_running_requests(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    r0 = _req(0, adapters[0])
    first = llm.generate("Hello", _params(), lora_request=r0, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("running", "Hello", _params(12), lora_request=r0)
    engine.step()
    assert engine.remove_lora("a0")
    assert engine.lora_manager.holds("a0")                # still used by "running"
    assert [r.lora_name for r in engine.list_loras()] == []
    with pytest.raises(LoRAAdapterNotFoundError, match="being unloaded"):
        engine.add_request("late", "Hello", _params(), lora_request=r0)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["running"].outputs[0].token_ids[:8] == first   # finished on the adapter's weights
    assert not engine.lora_manager.holds("a0")
    assert engine.scheduler.lora_slots.slot_of("a0") is None
    assert not engine.remove_lora("a0")
    # Loading it again works, and gives the same output.
    assert engine.add_lora(r0)
    again = llm.generate("Hello", _params(), lora_request=r0, use_tqdm=False)[0].outputs[0].token_ids
    assert again == first


def test_engine_add_lora_errors_and_keeps_serving(tiny_llama_dir, adapters, tmp_path):
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=1, max_lora_rank=4)
    engine = llm.llm_engine
    with pytest.raises(LoRAAdapterNotFoundError):
        engine.add_lora(LoRARequest("ghost", 5, str(tmp_path / "missing")))
    with pytest.raises(InvalidLoRAAdapterError, match="greater than max_lora_rank"):
        engine.add_lora(_req(1, adapters[1]))
    dora = tmp_path / "dora"
    import shutil
    shutil.copytree(adapters[0], dora)
    edit_adapter_config(dora, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        engine.add_request("bad", "Hello", _params(), lora_request=LoRARequest("dora", 6, str(dora)))
    assert not engine.has_unfinished_requests()
    assert engine.add_lora(_req(0, adapters[0])) and engine.add_lora(_req(0, adapters[0]))
    assert [r.lora_name for r in engine.list_loras()] == ["a0"]
    out = llm.generate(["Hello", "A"], _params(), lora_request=[None, _req(0, adapters[0])], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_engine_without_lora(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir))
    assert llm.llm_engine.list_loras() == [] and not llm.llm_engine.remove_lora("a0")
    with pytest.raises(ValueError, match="not enabled"):
        llm.llm_engine.add_lora(_req(0, adapters[0]))


def test_warm_up_kernels_runs_each_launch_key_once(tiny_llama_dir, monkeypatch):
    """``LoRAManager.warm_up_kernels`` (start-up compile of the eager steps' LoRA kernels): one
    layer call per distinct (shapes, launch configs) key over the token range, zero slots left
    untouched, no batch left behind; nothing on the torch backend."""
    if torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET (set on CPU-only machines)")
    from lora.layers import LinearLoRASlots

    model = _model(tiny_llama_dir)
    split_only = KernelPolicy(lora_stacked_max_tokens=0)                  # the split path's keys first
    mgr = LoRAManager(LoRAConfig(max_loras=4, max_lora_rank=8), model, torch.device("cpu"), torch.float32,
                      backend="triton", policy=split_only)
    assert mgr.policy is split_only and all(layer.stacked_weight is None for layer in mgr.layers.values())
    keys, forward = [], LinearLoRASlots.forward

    rows = []

    def spy(self, x, y):
        keys.append((self.input_size, tuple(self.output_sizes),
                     self.launch_key(x.shape[0], self.state.batch.meta.num_active)))
        rows.append(x.shape[0])
        return forward(self, x, y)
    monkeypatch.setattr(LinearLoRASlots, "forward", spy)
    silu_mul_shapes, finish_silu_mul = [], LinearLoRASlots.finish_silu_mul

    def silu_mul_spy(self, pending, y):
        silu_mul_shapes.append((self.input_size, tuple(self.output_sizes)))
        return finish_silu_mul(self, pending, y)
    monkeypatch.setattr(LinearLoRASlots, "finish_silu_mul", silu_mul_spy)
    norm_calls, finish_norm = [], LinearLoRASlots.finish_add_rms_norm

    def norm_spy(self, pending, x, *args):
        norm_calls.append((self.input_size, tuple(self.output_sizes), x.shape[0]))
        return finish_norm(self, pending, x, *args)
    monkeypatch.setattr(LinearLoRASlots, "finish_add_rms_norm", norm_spy)
    import kernels.lora_expand_norm as lora_expand_norm
    monkeypatch.setattr(lora_expand_norm, "TILES_MIN_TOKENS", 150)     # "long prefill" from 150 tokens here
    qkv_calls = []
    calls = mgr.warm_up_kernels(70, 200, qkv_consumer=lambda pending, qkv: qkv_calls.append(
        (pending.owner.input_size, tuple(pending.owner.output_sizes), qkv.shape[0])))
    assert calls == len(keys) == len(set(keys)) > 1                      # each key once
    # q/k/v: the update inside rotary + KV write (the runner's consumer) at decode sizes (<= 128)
    assert qkv_calls == [(*k[:2], t) for k, t in zip(keys, rows) if len(k[1]) == 3 and t <= 128] and qkv_calls
    gate_up = [k[:2] for k in keys if k[:2] == (model.config.hidden_size, (model.config.intermediate_size,) * 2)]
    assert silu_mul_shapes == gate_up and gate_up                        # the MLP's fused kernel too
    # o/down: the update inside add + RMSNorm for every key of a size that fuses it (<= 128 tokens:
    # per-row programs; >= 150 here: tiles), none between
    want = [(*k[:2], t) for k, t in zip(keys, rows) if len(k[1]) == 1 and (t <= 128 or t >= 150)]
    assert norm_calls == want and any(t >= 150 for *_, t in want) and any(t <= 128 for *_, t in want)
    shapes = {(layer.input_size, tuple(layer.output_sizes)) for layer in mgr.layers.values()}
    assert {k[:2] for k in keys} == shapes                                # every layer shape
    assert mgr.state.batch is None
    assert all(torch.count_nonzero(layer.lora_a) == 0 for layer in mgr.layers.values())
    assert mgr.warm_up_kernels(201, 200) == 0
    # Decode-sized steps with the stacked GEMM (the default up to 128 tokens): one begin_stacked +
    # finish per key (gate/up: and a begin_stacked + finish_silu_mul), the split path not at all.
    stacked_mgr = LoRAManager(LoRAConfig(max_loras=4, max_lora_rank=8), _model(tiny_llama_dir),
                              torch.device("cpu"), torch.float32, backend="triton", policy=KernelPolicy())
    stacked_keys, begin_stacked = [], LinearLoRASlots.begin_stacked

    rows_stacked = []

    def stacked_spy(self, x, weight):
        key = (self.input_size, tuple(self.output_sizes), self.launch_key(x.shape[0], self.state.batch.meta.num_active))
        if key not in stacked_keys:
            rows_stacked.append(x.shape[0])
        stacked_keys.append(key)
        return begin_stacked(self, x, weight)
    monkeypatch.setattr(LinearLoRASlots, "begin_stacked", stacked_spy)
    keys.clear()
    silu_mul_shapes.clear()
    norm_calls.clear()
    qkv_calls.clear()
    calls = stacked_mgr.warm_up_kernels(1, 8, qkv_consumer=lambda pending, qkv: qkv_calls.append(
        (pending.owner.input_size, tuple(pending.owner.output_sizes), qkv.shape[0])))
    assert not keys and calls == len(set(stacked_keys)) > 1 and all(k[2][0] == "stacked" for k in stacked_keys)
    assert silu_mul_shapes
    # o/down: the update inside add + RMSNorm over the stacked GEMM's output, once per key
    assert norm_calls == [(*k[:2], t) for k, t in zip(dict.fromkeys(stacked_keys), rows_stacked)
                          if len(k[1]) == 1] and norm_calls
    assert qkv_calls == [(*k[:2], t) for k, t in zip(dict.fromkeys(stacked_keys), rows_stacked)
                         if len(k[1]) == 3] and qkv_calls
    assert len(stacked_keys) == calls + len(silu_mul_shapes) + len(norm_calls) + len(qkv_calls)
    assert all(torch.count_nonzero(layer.lora_a) == 0 for layer in stacked_mgr.layers.values())
    torch_mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), _model(tiny_llama_dir),
                            torch.device("cpu"), torch.float32)
    assert torch_mgr.warm_up_kernels(1, 64) == 0


def test_warm_up_without_a_split_plan(tiny_llama_dir, monkeypatch):
    """With the overlap off, ``begin`` issues nothing (no split plan): the warm-up still runs every
    key, and the o/down norm fusion is simply not taken (``LinearLoRASlots.run`` returns such
    updates complete, so the norm never gets one)."""
    if torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET (set on CPU-only machines)")
    import kernels.lora_expand_norm as lora_expand_norm

    monkeypatch.setattr(lora_expand_norm, "TILES_MIN_TOKENS", 150)
    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), _model(tiny_llama_dir), torch.device("cpu"),
                      torch.float32, backend="triton",
                      policy=KernelPolicy(lora_stacked_max_tokens=0, lora_overlap=False))
    assert not any(layer.overlap for layer in mgr.layers.values())
    assert mgr.warm_up_kernels(150, 160) > 0 and mgr.state.batch is None


def test_tune_stacked_cover(tiny_llama_dir):
    """``tune_stacked_cover``: per layer shape and step size, the stacked GEMM covers more slots than
    the bound only where the timer finds it at least STACKED_COVER_MIN_GAIN faster; every layer of
    that shape gets the choice, the step's result is unchanged, and nothing is tuned on the torch
    backend or for a bound of max_loras."""
    import numpy as np

    from lora.manager import STACKED_COVER_MIN_GAIN, stacked_cover_candidates

    if torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET (set on CPU-only machines)")
    assert stacked_cover_candidates(16, 64) == [16, 20, 24, 28, 32]
    assert stacked_cover_candidates(16, 22) == [16, 20] and stacked_cover_candidates(2, 8) == [2, 3, 4]
    mgr = LoRAManager(LoRAConfig(max_loras=8, max_lora_rank=8), _model(tiny_llama_dir), torch.device("cpu"),
                      torch.float32, backend="triton")
    layers = list(mgr.layers.values())
    # o_proj and down_proj: one slice of hidden_size columns (their GEMMs' widths are alike)
    o_layers = [l for l in layers if len(l.output_sizes) == 1]
    o_rows = {sum(o_layers[0].output_sizes) + c * o_layers[0].max_rank for c in (2, 3, 4)}
    seen = []

    bound_rows = {sum(l.output_sizes) + 2 * l.num_slices * l.max_rank for l in layers}

    def timer(calls):
        seen.append(len(calls))
        cols = calls[0]().shape[1]
        if cols in o_rows:                            # o/down: covering 3 slots is 10% faster than 2
            return 0.9 if cols == min(o_rows) + o_layers[0].max_rank else 1.0
        # elsewhere: wider covers 1% faster than the bound, within the spread, so the bound stays
        return 1.0 if cols in bound_rows else 1.0 - STACKED_COVER_MIN_GAIN / 3

    rng = torch.get_rng_state()
    chosen = mgr.tune_stacked_cover([1, 4, 200], 2, timer=timer)
    assert torch.equal(torch.get_rng_state(), rng)                               # its inputs: own generator
    shapes = {(l.input_size, tuple(l.output_sizes)) for l in layers}
    assert set(chosen) == {(shape, t) for shape in shapes for t in (1, 4)}       # 200 > the stacked bound
    assert all(v == (3 if len(shape[1]) == 1 else 2) for (shape, _), v in chosen.items())
    assert set(seen) == {len(o_layers) // 2}                                     # every layer of a shape
    assert all(l.stacked_cover == ({(1, 2): 3, (4, 2): 3} if l in o_layers else {}) for l in layers)
    # A step over slots below 2 through a tuned o_proj / down_proj: same output as at the bound.
    layer = o_layers[0]
    torch.manual_seed(0)
    a = torch.randn(layer.max_rank, layer.input_size) * 0.1
    b = torch.randn(layer.output_sizes[0], layer.max_rank) * 0.1
    layer.set_slice(1, 0, LoRASliceWeights(a, b))
    x = torch.randn(4, layer.input_size)
    base = layer.stacked_weight[:layer.output_sizes[0]]
    mgr.set_batch(np.array([1, -1, 0, 1], dtype=np.int32), fixed_grid=True, max_active=2)
    assert mgr.state.batch.slot_bound == 2
    ys = []
    for cover in ({(4, 2): 3}, {}):
        layer.stacked_cover = dict(cover)
        y, pending = layer.begin_stacked(x, base)
        layer.finish(pending, y)
        ys.append(y.clone())
    torch.testing.assert_close(ys[0], ys[1])
    torch.testing.assert_close(ys[0][0], x[0] @ base.T + (x[0] @ a.T) @ b.T, atol=1e-4, rtol=1e-4)
    mgr.state.batch = None
    # A slow first sample of the bound (noise): its second sample decides, the bound stays.
    samples = {}

    def noisy(calls):
        cols = calls[0]().shape[1]
        samples[cols] = samples.get(cols, 0) + 1
        at_bound = cols in (sum(l.output_sizes) + 2 * l.num_slices * l.max_rank for l in layers)
        return 2.0 if at_bound and samples[cols] == 1 else 1.0
    assert set(mgr.tune_stacked_cover([4], 2, timer=noisy).values()) == {2}
    assert all((4, 2) not in l.stacked_cover for l in layers)
    assert mgr.tune_stacked_cover([4], 8, timer=timer) == {}                      # bound = max_loras
    torch_mgr = LoRAManager(LoRAConfig(max_loras=8, max_lora_rank=8), _model(tiny_llama_dir),
                            torch.device("cpu"), torch.float32)
    assert torch_mgr.tune_stacked_cover([4], 2, timer=timer) == {}


def test_rotary_qkv_consumer_adds_the_update(tiny_llama_dir):
    """``LlamaAttention.rotary_qkv_consumer`` (the warm-up's q/k/v consumer): the attention's
    rotary + KV write with the pending q/k/v update, at position 0 (no rotation) and with no cache
    write: q, k, v become the projection plus the update, the cache stays empty."""
    import numpy as np

    if torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET (set on CPU-only machines)")
    model = _model(tiny_llama_dir)
    mgr = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), model, torch.device("cpu"), torch.float32,
                      backend="triton")
    attn = model.model.layers[0].self_attn
    layer = attn.qkv_proj.adapter
    paged = attn.attn
    paged.k_cache = torch.zeros(2, 16, paged.num_kv_heads, paged.head_dim)
    paged.v_cache = torch.zeros_like(paged.k_cache)
    torch.manual_seed(0)
    for s, size in enumerate(layer.output_sizes):
        layer.set_slice(1, s, LoRASliceWeights(torch.randn(8, layer.input_size) * 0.1, torch.randn(size, 8) * 0.1))
    mgr.set_batch(np.array([1, -1, 1], dtype=np.int32), fixed_grid=True)   # slots written directly: no names
    x = torch.randn(3, layer.input_size)
    qkv = torch.randn(3, sum(layer.output_sizes))
    want = qkv.clone()
    layer.finish(layer.begin(x), want)
    assert not torch.allclose(want, qkv)
    attn.rotary_qkv_consumer()(layer.begin(x), qkv)
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)
    assert not paged.k_cache.any() and not paged.v_cache.any()
    mgr.state.batch = None
