"""Greedy parity with transformers + PEFT: 4 adapters and the base model in one generate call.

The adapters differ in rank (4, 8, 16), alpha, target set (all 7; q,v; mlp; attention by regex)
and scale rule (one rsLoRA); B is random and non-zero. Each request must give the same greedy
32 tokens as PEFT on its adapter (vLLM's top-5 rule, 1e-3 logprob tolerance), also when slots
are scarcer than adapters (swaps), when the host store is (reloads), and with chunked prefill
and prefix caching, where two adapters must never share KV.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from lora import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import EagerReplayGraphs, check_logprobs_close, ours_as_ref

MAX_TOKENS = 16
ADAPTERS = {   # name -> (r, alpha, target_modules, use_rslora)
    "r4-all": (4, 8, ALL_TARGETS, False),
    "r8-qv": (8, 32, ["q_proj", "v_proj"], False),
    "r16-mlp-rslora": (16, 16, ["gate_proj", "up_proj", "down_proj"], True),
    "r8-attn-regex": (8, 8, r".*\.(q|k|v|o)_proj", False),
}
SHARED = ("Paged attention keeps the KV cache in fixed-size blocks. A scheduler hands out one token "
          "budget per step to running and waiting requests. ")


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tiny_prompts, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("parity-adapters")
    paths = {name: build_peft_adapter(tiny_llama_dir, root / name, r=r, lora_alpha=alpha, target_modules=t,
                                      seed=i + 1, use_rslora=rs)
             for i, (name, (r, alpha, t, rs)) in enumerate(ADAPTERS.items())}
    lora_reqs = {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())}
    names = list(ADAPTERS)
    # 10 requests: every adapter twice, the base model twice; prompts 0 and 2 under two adapters.
    plan = [(0, None), (1, names[0]), (2, names[1]), (3, names[2]), (4, names[3]),
            (5, None), (6, names[0]), (7, names[1]), (0, names[2]), (2, names[3])]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    pm = peft_reference_model(tiny_llama_dir, paths)
    prompts = [tiny_prompts[p] for p, _ in plan]
    refs = [peft_greedy(pm, a, tok.encode(tiny_prompts[p]), MAX_TOKENS) for p, a in plan]
    return dict(dir=str(tiny_llama_dir), prompts=prompts, adapters=[a for _, a in plan], lora_reqs=lora_reqs,
                refs=refs, pm=pm, tok=tok)


def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _run_and_check(s, **engine_kwargs):
    llm = LLM(s["dir"], enable_lora=True, **engine_kwargs)
    reqs = [None if a is None else s["lora_reqs"][a] for a in s["adapters"]]
    outputs = llm.generate(s["prompts"], _params(), lora_request=reqs, use_tqdm=False)
    assert [o.prompt for o in outputs] == s["prompts"]
    exact = 0
    for i, (out, ref) in enumerate(zip(outputs, s["refs"])):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"request {i} ({s['adapters'][i]})")
        exact += out.outputs[0].token_ids == ref.token_ids
    assert exact >= 8, f"only {exact}/10 requests match PEFT exactly"
    return llm, outputs


def test_references_differ_per_adapter(setup):
    """Sanity: each adapter changes the output (else parity would prove nothing)."""
    refs = setup["refs"]
    assert refs[0].token_ids != refs[8].token_ids      # prompt 0: base vs r16-mlp-rslora
    assert refs[2].token_ids != refs[9].token_ids      # prompt 2: r8-qv vs r8-attn-regex
    base = {p: r.token_ids for p, a, r in zip(setup["prompts"], setup["adapters"], refs) if a is None}
    assert len(base) == 2


def test_mixed_batch(setup):
    llm, _ = _run_and_check(setup, max_loras=4, max_lora_rank=16)
    engine = llm.llm_engine
    assert engine.get_stats().max_reqs_per_step == 10     # all adapters and the base model in one step
    assert engine.lora_manager.num_slot_loads == 4


def test_slot_swaps(setup):
    llm, _ = _run_and_check(setup, max_loras=2, max_lora_rank=16)
    assert llm.llm_engine.lora_manager.num_slot_loads >= 4   # 4 adapters through 2 slots


def test_host_store_reloads(setup):
    llm, _ = _run_and_check(setup, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    store = llm.llm_engine.lora_manager.store
    assert store.num_evictions > 0 and store.num_loads > 4 and len(store) <= 2


def test_chunked_prefill_and_prefix_caching(setup):
    _run_and_check(setup, max_loras=3, max_lora_rank=16, max_num_batched_tokens=16, max_num_seqs=4,
                   enable_prefix_caching=True)


def test_prefix_cache_never_shared_across_adapters(setup):
    """Prompts sharing a long prefix, one generate call each: hits only within one adapter."""
    s = setup
    p0, p1 = SHARED + "The quick brown fox", SHARED + "Hello"
    # (prompt, adapter, expect cache hits)
    runs = [(p0, None, False), (p0, "r4-all", False), (p0, "r8-attn-regex", False),
            (p1, "r4-all", True), (p1, None, True), (p1, "r8-attn-regex", True), (p0, "r4-all", True)]
    llm = LLM(s["dir"], enable_lora=True, max_loras=2, max_lora_rank=16, enable_prefix_caching=True)
    outs = []
    for prompt, adapter, expect_hits in runs:
        req = None if adapter is None else s["lora_reqs"][adapter]
        out = llm.generate(prompt, _params(), lora_request=req, use_tqdm=False)[0]
        ref = peft_greedy(s["pm"], adapter, s["tok"].encode(prompt), MAX_TOKENS)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"{adapter} / {prompt[-12:]}")
        assert (out.num_cached_tokens >= 16) == expect_hits, (adapter, prompt[-12:], out.num_cached_tokens)
        outs.append(out.outputs[0].token_ids)
    assert outs[0] != outs[1] != outs[2] and outs[0] != outs[2]   # the same prompt, three models
    assert outs[6] == outs[1]


def test_graph_path_with_lora_on_cpu(setup):
    """The runner's CUDA-graph path (padded layouts, LoRA graph variants) run eagerly on CPU
    (``EagerReplayGraphs``): mixed steps with adapters, decode steps with and without adapters,
    all matching PEFT."""
    s = setup
    llm = LLM(s["dir"], enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=48,
              max_num_seqs=5, enable_prefix_caching=False)
    graphs = EagerReplayGraphs.install(llm, token_sizes=[16, 32, 48])
    kinds = []
    replay = graphs.replay
    graphs.replay = lambda key: kinds.append(key) or replay(key)
    reqs = [None if a is None else s["lora_reqs"][a] for a in s["adapters"]]
    # The base-model requests last: the final decode steps run the graph variant without LoRA.
    order = sorted(range(len(reqs)), key=lambda i: reqs[i] is None)
    outputs = llm.generate([s["prompts"][i] for i in order], _params(), lora_request=[reqs[i] for i in order],
                           use_tqdm=False)
    for out, i in zip(outputs, order):
        check_logprobs_close(s["refs"][i], ours_as_ref(out.outputs[0]), name=f"request {i} ({s['adapters'][i]})")
    assert any(k.mixed and k.lora for k in kinds)
    assert any(not k.mixed and k.lora for k in kinds)
    assert any(not k.mixed and not k.lora for k in kinds)
    assert any(k.mixed and not k.lora for k in kinds)


def _generate(s, max_loras=4, **engine_kwargs):
    llm = LLM(s["dir"], enable_lora=True, max_loras=max_loras, max_lora_rank=16, gpu_memory_utilization=0.3,
              max_num_seqs=16, **engine_kwargs)
    reqs = [None if a is None else s["lora_reqs"][a] for a in s["adapters"]]
    outputs = [o.outputs[0] for o in llm.generate(s["prompts"], _params(), lora_request=reqs, use_tqdm=False)]
    return llm, outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_with_lora_match_eager_and_peft(setup):
    """Decode steps replay CUDA graphs with the fixed-grid LoRA kernels: float32 output matches
    PEFT and the eager (exact-grid) run; bfloat16 graphs match bfloat16 eager."""
    s = setup
    runs = {}
    for dtype in ("float32", "bfloat16"):
        for eager in (True, False):
            llm, outputs = _generate(s, dtype=dtype, enforce_eager=eager)
            graphs = llm.llm_engine.runner.graphs
            if eager:
                assert graphs is None
            else:
                assert graphs is not None and graphs.num_replays >= MAX_TOKENS - 2
            runs[dtype, eager] = outputs
            del llm
            torch.cuda.empty_cache()
    exact = 0
    for i, ref in enumerate(s["refs"]):
        for eager in (True, False):
            name = f"float32 {'eager' if eager else 'graphs'} request {i} ({s['adapters'][i]})"
            check_logprobs_close(ref, ours_as_ref(runs["float32", eager][i]), name=name, atol=5e-3)
        exact += runs["float32", False][i].token_ids == ref.token_ids
        check_logprobs_close(ours_as_ref(runs["bfloat16", True][i]), ours_as_ref(runs["bfloat16", False][i]),
                             name=f"bfloat16 graphs vs eager, request {i}", atol=0.05)
    assert exact >= 8, f"only {exact}/10 graph requests match PEFT exactly"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_with_wider_stacked_gemms_match_peft(setup, monkeypatch):
    """With more slots than the few-adapters graphs cover (20 > 16), start-up tunes how many slots
    the stacked decode GEMMs cover (``LoRAManager.tune_stacked_cover``); here a fake timer makes
    every wider cover win, so the few-adapters graphs run GEMMs over 20 slots' rows while their
    tokens sit below 16: float32 output still matches PEFT."""
    from lora.manager import LoRAManager

    tune = LoRAManager.tune_stacked_cover
    monkeypatch.setattr(LoRAManager, "tune_stacked_cover", lambda self, sizes, bound: tune(
        self, sizes, bound, timer=lambda calls: 1.0 / calls[0]().shape[1]))   # wider: faster
    llm, outputs = _generate(s=setup, max_loras=20, dtype="float32")
    runner = llm.llm_engine.runner
    covers = {c for layer in runner.lora_manager.layers.values() for c in layer.stacked_cover.values()}
    assert covers == {20} and runner.graphs.num_replays >= MAX_TOKENS - 2
    for i, ref in enumerate(setup["refs"]):
        check_logprobs_close(ref, ours_as_ref(outputs[i]), name=f"request {i} ({setup['adapters'][i]})", atol=5e-3)


VARIANTS = {   # adapter_config settings real adapters carry, beyond the 4 adapters above
    "layers-to-transform": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS, layers_to_transform=[1]),
    "rank-alpha-pattern": dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS,
                               rank_pattern={"q_proj": 16, "down_proj": 2}, alpha_pattern={"v_proj": 3.0}),
    "all-linear": dict(r=8, lora_alpha=8, target_modules="all-linear"),
    "exclude-modules": dict(r=8, lora_alpha=8, target_modules=ALL_TARGETS, exclude_modules=["o_proj"]),
}


def test_adapter_config_variants_match_peft(tiny_llama_dir, tiny_prompts, tmp_path_factory):
    """layers_to_transform, rank/alpha patterns, "all-linear" and exclude_modules, all in one
    generate call next to the base model: each request equals PEFT on its adapter."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("variant-adapters")
    paths = {name: build_peft_adapter(tiny_llama_dir, root / name, seed=10 + i, **kw)
             for i, (name, kw) in enumerate(VARIANTS.items())}
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    pm = peft_reference_model(tiny_llama_dir, paths)
    plan = [(i % len(tiny_prompts), name) for i, name in enumerate(VARIANTS)] + [(0, None)]
    refs = [peft_greedy(pm, a, tok.encode(tiny_prompts[p]), 16) for p, a in plan]
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=4, max_lora_rank=16)
    reqs = [None if a is None else LoRARequest(a, i + 1, str(paths[a])) for i, (_, a) in enumerate(plan)]
    outs = llm.generate([tiny_prompts[p] for p, _ in plan],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5),
                        lora_request=reqs, use_tqdm=False)
    for (p, a), ref, out in zip(plan, refs, outs):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"{a} / prompt {p}")
    assert len({tuple(r.token_ids) for r in refs}) > 1          # the adapters change the output


@pytest.mark.parametrize("arch, overrides", [
    ("qwen2", {}),                                          # q/k/v biases under the adapter
    ("llama", dict(num_key_value_heads=1, head_dim=24)),    # MQA, head_dim != hidden / heads
    ("mistral", {}),
], ids=["qwen2", "llama-mqa-hd24", "mistral"])
def test_other_architectures_match_peft(arch, overrides, tmp_path):
    from transformers import AutoTokenizer

    from tests.conftest import build_tiny_checkpoint

    d = build_tiny_checkpoint(tmp_path / arch, arch=arch, seed=3, **overrides)
    path = build_peft_adapter(d, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=ALL_TARGETS, seed=7)
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok.encode("The quick brown fox jumps")
    ref = peft_greedy(peft_reference_model(d, {"a": path}), "a", ids, 16)
    llm = LLM(str(d), enable_lora=True, max_loras=2, max_lora_rank=16)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                 logprobs=5),
                       lora_request=LoRARequest("a", 1, str(path)), use_tqdm=False)[0]
    check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=arch)


def test_fused_decode_path_with_adapters_on_cpu(setup, monkeypatch):
    """Small steps take the fused GEMV path (forced on CPU) only where no adapter runs: steps
    with adapters keep the unfused projections and their LoRA updates; all outputs match PEFT."""
    from tests.models.test_fused_decode import force_fused_on_cpu

    s = setup
    calls = force_fused_on_cpu(monkeypatch)
    llm = LLM(s["dir"], enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=2)
    # The base-model requests last: the final decode steps hold no adapter.
    order = sorted(range(len(s["adapters"])), key=lambda i: s["adapters"][i] is None)
    reqs = [None if s["adapters"][i] is None else s["lora_reqs"][s["adapters"][i]] for i in order]
    outputs = llm.generate([s["prompts"][i] for i in order], _params(), lora_request=reqs, use_tqdm=False)
    for out, i in zip(outputs, order):
        check_logprobs_close(s["refs"][i], ours_as_ref(out.outputs[0]), name=f"request {i} ({s['adapters'][i]})")
    assert calls["add_rms_norm_gemv"] > 0
