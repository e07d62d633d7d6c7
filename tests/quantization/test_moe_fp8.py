"""FP8 MoE models (Qwen3-MoE, Mixtral): FP8 checkpoints with per-expert tensors (HF block-wise ``fp8`` as the
Qwen3-MoE FP8 releases ship, compressed-tensors FP8_DYNAMIC per channel; ``formats.build_moe_fp8``) and
``--quantization fp8`` on a float checkpoint, against transformers on the dequantized weights (CPU, float32:
the experts hold the dequantized weights, so tokens equal and logprobs within 1e-4 as
``test_checkpoints.EXACT_ATOL``); adapters on attention, experts and router of an FP8 base against PEFT on the
dequantized checkpoint; the routers stay float; start-up errors. On CUDA (``gpu``) the fused MoE kernels read
the e4m3 experts and their scales, against the same checkpoint with its experts dequantized: float32 exact but
for the summation order, bfloat16 by vLLM's top-5 rule."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Optional

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.fp8_experts import Fp8Experts
from engine.layers.linear import Linear
from engine.layers.moe import FusedMoE, SparseMoeBlock
from engine.quantization.slices import Fp8Slice
from lora import LoRARequest
from tests.conftest import build_tiny_checkpoint
from tests.lora.utils import peft_greedy, peft_reference_model
from tests.models.test_moe_lora import per_expert_adapter
from tests.models.utils import check_logprobs_close, hf_float32, hf_greedy, ours_as_ref
from tests.quantization import formats as F

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache in fixed-size blocks."]
EXACT_ATOL = 1e-4
"""CPU float32 on the reference's own (dequantized) weights: only the summation order differs."""
GPU_F32_ATOL = 1e-3
"""CUDA float32, e4m3 experts against the same experts dequantized (the same W8A8 attention): the kernels
widen e4m3 exactly, so only the summation order differs (measured: 0.0000 on H100)."""
GPU_BF16_ATOL = 0.25
"""CUDA bfloat16, e4m3 experts against the same experts dequantized to bfloat16 (the same W8A8 attention): the
kernels scale after the dot, the reference rounds each scaled weight to bfloat16 (bfloat16 against float32 on
the same weights: 0.10). Against the dequantized checkpoint, whose attention runs unquantized activations, the
tiny random models' logprobs move by up to 0.43 from the e4m3 activations alone and a near-flat step can put
the argmax outside the other's top 5: that comparison is ``benchmarks/quantized_check.py``'s, on real shapes."""

FLOAT_MODELS = {   # name -> (model_type, overrides): 32 x 32 scale blocks tile every projection
    "qwen3moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                   norm_topk_prob=True, head_dim=32)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
    "qwen2moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=32, initializer_range=0.1)),
}
VARIANTS = {"qwen3moe-fp8-block": ("qwen3moe", "fp8-block"), "qwen3moe-ct-fp8": ("qwen3moe", "ct-fp8-dynamic"),
            "mixtral-fp8-block": ("mixtral", "fp8-block"), "qwen2moe-ct-fp8": ("qwen2moe", "ct-fp8-dynamic")}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            arch, overrides = FLOAT_MODELS[name]
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, seed=3, **overrides)
        return built[name]
    return get


@pytest.fixture(scope="module")
def fp8_dirs(float_dirs, tmp_path_factory):
    """Variant -> (FP8 checkpoint, float32 checkpoint of its dequantized weights, the dequantized state dict)."""
    built = {}

    def get(name: str):
        if name not in built:
            base, fmt = VARIANTS[name]
            out, deq = F.build_moe_fp8(tmp_path_factory.mktemp(name), float_dirs(base), fmt=fmt)
            built[name] = (out, F.write_dequantized_checkpoint(out, deq), deq)
        return built[name]
    return get


def cpu_engine(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", max_model_len=128, seed=0, **kw)


def check_against_hf(llm: LLM, reference_dir: Path, atol: float = EXACT_ATOL) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reference_dir)
    hf = hf_float32(reference_dir)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, tok.encode(prompt), MAX_TOKENS)
        ours = ours_as_ref(out.outputs[0])
        if atol <= EXACT_ATOL:                            # else paths may part at near-ties (vLLM's top-5 rule)
            assert ours.token_ids == ref.token_ids, prompt
        check_logprobs_close(ref, ours, prompt, atol=atol)


def experts_of(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]


def check_projections(llm: LLM, weight_class: type) -> None:
    """The routers (and shared-expert gates) of ``llm`` are float and every other projection holds a
    ``weight_class`` weight."""
    model = llm.llm_engine.core.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    routers = [m.gate for m in blocks] + [m.shared_expert_gate for m in blocks if m.shared_expert_gate is not None]
    assert routers and all(r.weight is not None and r.weight_q is None for r in routers)
    others = [m for m in model.modules() if isinstance(m, Linear) and all(m is not r for r in routers)]
    assert others and all(isinstance(m.weight_q, weight_class) for m in others)


def check_experts_hold(llm: LLM, deq: dict[str, torch.Tensor], mixtral: bool) -> None:
    """Every expert of ``llm`` holds exactly the weights of the dequantized state dict ``deq``."""
    block = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    experts = experts_of(llm)
    assert experts
    for layer, moe in enumerate(experts):
        inter = moe.intermediate_size
        w13, w2 = moe.w13, moe.w2
        if moe.cpu_quantized is not None:                     # weight-only quantized on CPU: their values
            w13, w2 = (torch.stack([w.dequantize(torch.float32) for w in ws]) for ws in moe.cpu_quantized)
        for e in range(moe.num_experts):
            prefix = f"model.layers.{layer}.{block}.experts.{e}"
            torch.testing.assert_close(w13[e, :inter], deq[f"{prefix}.{names[0]}.weight"], rtol=0, atol=0)
            torch.testing.assert_close(w13[e, inter:], deq[f"{prefix}.{names[1]}.weight"], rtol=0, atol=0)
            torch.testing.assert_close(w2[e], deq[f"{prefix}.{names[2]}.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp8_moe_checkpoint_matches_transformers_on_its_dequantized_weights(variant, fp8_dirs):
    fp8_dir, reference_dir, deq = fp8_dirs(variant)
    llm = cpu_engine(fp8_dir)
    # Every projection but the routers is FP8; the experts hold exactly the checkpoint's dequantized weights.
    check_projections(llm, Fp8Weight)
    check_experts_hold(llm, deq, mixtral=variant.startswith("mixtral"))
    check_against_hf(llm, reference_dir)


def test_quantization_fp8_quantizes_the_experts_per_channel_and_keeps_the_routers(float_dirs, tmp_path):
    float_dir = float_dirs("qwen3moe")
    llm = cpu_engine(float_dir, quantization="fp8")
    src = F.read_tensors(float_dir)
    # The reference: the float checkpoint with each projection and expert replaced by its FP8 round trip.
    ref = dict(src)
    for name in F.moe_projection_names(src):
        if ".experts." not in name:
            ref[name] = Fp8Weight.from_float(src[name], torch.float32).dequantize(torch.float32)
    for moe_idx, moe in enumerate(experts_of(llm)):
        prefix = f"model.layers.{moe_idx}.mlp"
        assert torch.equal(llm.llm_engine.core.runner.model.model.layers[moe_idx].mlp.gate.weight,
                           src[f"{prefix}.gate.weight"])                       # the router stays float
        gate = torch.stack([src[f"{prefix}.experts.{e}.gate_proj.weight"] for e in range(moe.num_experts)])
        up = torch.stack([src[f"{prefix}.experts.{e}.up_proj.weight"] for e in range(moe.num_experts)])
        down = torch.stack([src[f"{prefix}.experts.{e}.down_proj.weight"] for e in range(moe.num_experts)])
        w13, w2 = Fp8Experts.from_float(torch.cat([gate, up], dim=1), down).dequantize(torch.float32)
        assert torch.equal(moe.w13, w13) and torch.equal(moe.w2, w2)
        assert not torch.equal(w2, down)                                       # FP8 changed the values
        inter = moe.intermediate_size
        for e in range(moe.num_experts):
            ref[f"{prefix}.experts.{e}.gate_proj.weight"] = w13[e, :inter]
            ref[f"{prefix}.experts.{e}.up_proj.weight"] = w13[e, inter:]
            ref[f"{prefix}.experts.{e}.down_proj.weight"] = w2[e]
    (tmp_path / "q").mkdir()
    for file in float_dir.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / "q" / file.name).write_bytes(file.read_bytes())
    reference_dir = F.write_dequantized_checkpoint(tmp_path / "q", ref, out_dir=tmp_path / "ref")
    check_against_hf(llm, reference_dir)


def check_adapters_match_peft(quantized_dir: Path, reference_dir: Path, tmp_path: Path,
                              atol: float = EXACT_ATOL) -> None:
    """Two adapters on attention, experts and router, mixed with a base request in one batch on the quantized
    checkpoint, against PEFT (and transformers) on its dequantized one."""
    from transformers import AutoTokenizer

    adapters = {name: per_expert_adapter(reference_dir, tmp_path / name, r=8, alpha=16, seed=seed)
                for seed, name in enumerate(["a", "b"])}
    prompt_ids = AutoTokenizer.from_pretrained(reference_dir).encode(PROMPTS[0])
    refs = {None: hf_greedy(hf_float32(reference_dir), prompt_ids, MAX_TOKENS)}
    for name, path in adapters.items():
        pm = peft_reference_model(reference_dir, {name: path})
        refs[name] = peft_greedy(pm, name, prompt_ids, MAX_TOKENS)
        assert refs[name].token_ids != refs[None].token_ids                  # the adapter changes the output
    llm = cpu_engine(quantized_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    names = [None, "a", "b"]
    requests = [None if n is None else LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(names)]
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * 3, GREEDY, lora_request=requests, use_tqdm=False)
    for name, out in zip(names, outs):
        check_logprobs_close(refs[name], ours_as_ref(out.outputs[0]), f"adapter {name}", atol=atol)


def test_adapters_on_an_fp8_moe_base_match_peft_on_its_dequantized_weights(fp8_dirs, tmp_path):
    fp8_dir, reference_dir, _ = fp8_dirs("qwen3moe-fp8-block")
    check_adapters_match_peft(fp8_dir, reference_dir, tmp_path)


def test_unstackable_scale_blocks_are_refused_in_one_line():
    # Scale blocks of 128 rows over an expert's 96 gate rows: gate|up cannot stack into one weight.
    w = torch.zeros(96, 256, dtype=torch.float8_e4m3fn)
    gate = [Fp8Slice(w, torch.ones(1, 2), (128, 128))]
    down = [Fp8Slice(w.t().contiguous(), torch.ones(2, 1), (128, 128))]
    with pytest.raises(ValueError, match=r"gate / up projections of 96 rows do not fill whole 128-row scale"):
        Fp8Experts.from_slices(gate, gate, down)
    with pytest.raises(ValueError, match=r"mix per-channel and per-block scales"):
        Fp8Experts.from_slices(gate, [Fp8Slice(w, torch.ones(96), None)], down)


def test_dummy_fp8_moe_quantizes_the_experts_as_drawn(float_dirs):
    llm = LLM(model=str(float_dirs("qwen3moe")), load_format="dummy", device="cpu", dtype="float32",
              quantization="fp8", max_model_len=64, seed=0)
    ref = LLM(model=str(float_dirs("qwen3moe")), load_format="dummy", device="cpu", dtype="float32",
              max_model_len=64, seed=0)
    for moe, float_moe in zip(experts_of(llm), experts_of(ref)):
        w13, w2 = Fp8Experts.from_float(float_moe.w13, float_moe.w2).dequantize(torch.float32)
        assert torch.equal(moe.w13, w13) and torch.equal(moe.w2, w2)      # the same draws, quantized


def _experts_dequantized(monkeypatch) -> None:
    """Engines built after this keep the checkpoint's FP8 attention (W8A8) but hold the experts dequantized in
    the model's dtype: the reference that isolates the FP8 expert kernels."""
    set_fp8 = FusedMoE._set_fp8
    monkeypatch.setattr(FusedMoE, "_set_fp8",
                        lambda self, experts, dtype, dequantize: set_fp8(self, experts, dtype, True))


def _gpu_run(path: Path, dtype: str, prompts: list, lora_requests: Optional[list] = None, **kw
             ) -> tuple[list[FusedMoE], list]:
    """(the engine's MoE layers, greedy outputs) of ``prompts`` on CUDA."""
    gc.collect()                        # the previous engine's KV cache goes before this one sizes its own
    llm = LLM(model=str(path), device="cuda", dtype=dtype, max_model_len=128, seed=0,
              gpu_memory_utilization=0.3, **kw)
    outs = llm.generate(prompts, GREEDY, lora_request=lora_requests, use_tqdm=False)
    return experts_of(llm), [ours_as_ref(o.outputs[0]) for o in outs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpu_fp8_experts_run_quantized_and_match_the_dequantized_model(variant, fp8_dirs, monkeypatch):
    """Decode batches of 16 (the decode kernels) after their prefills (the sorted path). float32: the e4m3
    experts through the fused MoE kernels against the same checkpoint with only its experts dequantized (the
    same W8A8 attention): the kernels widen e4m3 exactly, so tokens are equal and logprobs within
    ``GPU_F32_ATOL``. bfloat16: the same comparison by vLLM's top-5 rule within ``GPU_BF16_ATOL``."""
    fp8_dir = fp8_dirs(variant)[0]
    prompts = PROMPTS * 8
    experts, ours = _gpu_run(fp8_dir, "float32", prompts)
    assert experts and all(m.fp8 is not None and m.w13.dtype == torch.float8_e4m3fn for m in experts)
    with monkeypatch.context() as m:
        _experts_dequantized(m)
        float_experts, refs = _gpu_run(fp8_dir, "float32", prompts)
    assert all(m.fp8 is None and m.w13.dtype == torch.float32 for m in float_experts)
    for i, (r, o) in enumerate(zip(refs, ours)):
        assert o.token_ids == r.token_ids, f"{variant}: request {i}"
        check_logprobs_close(r, o, f"{variant} vs its float32 experts: request {i}", atol=GPU_F32_ATOL)
    ours = _gpu_run(fp8_dir, "bfloat16", prompts)[1]
    with monkeypatch.context() as m:
        _experts_dequantized(m)
        refs = _gpu_run(fp8_dir, "bfloat16", prompts)[1]
    for i, (r, o) in enumerate(zip(refs, ours)):
        check_logprobs_close(r, o, f"{variant} vs its bfloat16 experts: request {i}", atol=GPU_BF16_ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_adapters_on_fp8_experts_match_the_dequantized_experts(fp8_dirs, tmp_path, monkeypatch):
    """``kernels.fused_moe_lora`` with e4m3 experts (block scales) and adapters on attention, experts and
    router, mixed with base requests, against the same adapters and checkpoint with its experts dequantized
    (float32 on CUDA, the same W8A8 attention: tokens equal, logprobs within ``GPU_F32_ATOL``)."""
    fp8_dir, reference_dir, _ = fp8_dirs("qwen3moe-fp8-block")
    adapters = {name: per_expert_adapter(reference_dir, tmp_path / name, r=8, alpha=16, seed=seed)
                for seed, name in enumerate(["a", "b"])}
    names = [None, "a", "b"] * 4
    requests = [None if n is None else LoRARequest(n, 1 + (n == "b"), str(adapters[n])) for n in names]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    kw = dict(lora_requests=requests, enable_lora=True, max_loras=2, max_lora_rank=8)
    ours = _gpu_run(fp8_dir, "float32", prompts, **kw)[1]
    with monkeypatch.context() as m:
        _experts_dequantized(m)
        refs = _gpu_run(fp8_dir, "float32", prompts, **kw)[1]
    assert [o.token_ids for o in ours[1::3]] != [o.token_ids for o in ours[0::3]]    # the adapters act
    for i, (r, o) in enumerate(zip(refs, ours)):
        assert o.token_ids == r.token_ids, f"request {i} ({names[i] or 'base'})"
        check_logprobs_close(r, o, f"request {i} ({names[i] or 'base'})", atol=GPU_F32_ATOL)
