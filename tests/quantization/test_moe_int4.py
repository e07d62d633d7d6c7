"""4-bit and weight-only quantized MoE experts. Checkpoints (GPTQ symmetric and act-order, AWQ GEMM) as the
GPTQ / AWQ releases of Qwen3-MoE, Mixtral and Qwen1.5-MoE quantize them: attention, every expert's and the
shared expert's projections 4-bit, routers and the shared expert's gate float. On CPU Chorus keeps them 4-bit (each expert's ``W4A16Weight``s run by the expert path), on CUDA
the experts load dequantized (no 4-bit expert kernel); the experts hold exactly the checkpoint's weights,
greedy follows vLLM's top-5 rule against transformers on the dequantized checkpoint (the int4 kernel rounds
activations to bfloat16 on CPU: ``test_checkpoints.INT4_ATOL``), ``--quantization none`` is exact, and
adapters on attention and experts follow PEFT on the dequantized checkpoint. ``--quantization int8|int4``
quantizes a float MoE's experts on CPU; the expert path over quantized weights computes their dequantized
weights within the packed kernels' rounding. On CUDA (``gpu``): bfloat16 against the dequantized
checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.layers.linear import Linear
from engine.layers.moe import fused_moe_ref, select_experts
from engine.layers.quantized import PACKED_MAX_TOKENS, Int4Weight, Int8Weight, quantize_weight
from engine.layers.w4a16 import W4A16Weight
from tests.conftest import build_tiny_checkpoint
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.quantization import formats as F
from tests.quantization.test_checkpoints import EXACT_ATOL, INT4_ATOL, INT4_LINEAR_RTOL
from tests.quantization.test_moe_fp8 import (FLOAT_MODELS, GREEDY, PROMPTS, check_adapters_match_peft,
                                             check_against_hf, check_experts_hold, check_projections,
                                             cpu_engine, experts_of)

VARIANTS = {"qwen3moe-gptq": ("qwen3moe", "gptq"), "qwen3moe-gptq-actorder": ("qwen3moe", "gptq-actorder"),
            "mixtral-awq": ("mixtral", "awq"), "qwen2moe-gptq-actorder": ("qwen2moe", "gptq-actorder")}


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory):
    """Variant -> (4-bit checkpoint, float32 checkpoint of its dequantized weights, its dequantized state
    dict)."""
    built = {}

    def get(name: str):
        if name not in built:
            arch, fmt = VARIANTS[name]
            model_type, overrides = FLOAT_MODELS[arch]
            float_dir = build_tiny_checkpoint(tmp_path_factory.mktemp(arch), model_type, seed=3, **overrides)
            out, deq = F.build_moe_int4(tmp_path_factory.mktemp(name), float_dir, fmt=fmt)
            built[name] = (out, F.write_dequantized_checkpoint(out, deq), deq)
        return built[name]
    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_int4_moe_checkpoint_matches_transformers_on_its_dequantized_weights(variant, int4_dirs):
    int4_dir, reference_dir, deq = int4_dirs(variant)
    llm = cpu_engine(int4_dir)
    check_projections(llm, W4A16Weight)                        # float routers, every other projection 4-bit
    assert all(isinstance(w, W4A16Weight) for m in experts_of(llm) for ws in m.cpu_quantized for w in ws)
    check_experts_hold(llm, deq, variant.startswith("mixtral"))
    check_against_hf(llm, reference_dir, INT4_ATOL)


def test_quantization_none_runs_the_dequantized_moe_exactly(int4_dirs):
    int4_dir, reference_dir, deq = int4_dirs("qwen3moe-gptq-actorder")
    llm = cpu_engine(int4_dir, quantization="none")
    model = llm.llm_engine.core.runner.model
    assert all(m.weight_q is None for m in model.modules() if isinstance(m, Linear))
    check_experts_hold(llm, deq, mixtral=False)
    check_against_hf(llm, reference_dir, EXACT_ATOL)


def test_adapters_on_an_int4_moe_base_match_peft_on_its_dequantized_weights(int4_dirs, tmp_path):
    int4_dir, reference_dir, _ = int4_dirs("qwen3moe-gptq")
    check_adapters_match_peft(int4_dir, reference_dir, tmp_path, atol=INT4_ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpu_int4_moe_matches_its_dequantized_checkpoint(variant, int4_dirs):
    """bfloat16 on CUDA: the W4A16 attention kernels and the fused MoE kernels on the dequantized experts
    against the dequantized checkpoint, by vLLM's top-5 rule over decode batches of 16."""
    int4_dir, reference_dir, _ = int4_dirs(variant)
    outs = {}
    for label, path in (("int4", int4_dir), ("ref", reference_dir)):
        llm = LLM(model=str(path), device="cuda", dtype="bfloat16", max_model_len=128, seed=0,
                  gpu_memory_utilization=0.3)
        outs[label] = [ours_as_ref(o.outputs[0]) for o in llm.generate(PROMPTS * 8, GREEDY, use_tqdm=False)]
        if label == "int4":
            assert all(m.w13.dtype == torch.bfloat16 for m in experts_of(llm))
        llm.close()
    for i, (r, o) in enumerate(zip(outs["ref"], outs["int4"])):
        check_logprobs_close(r, o, f"{variant}: request {i}", atol=INT4_ATOL)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("num_tokens", [7, 300])
def test_weight_only_quantized_experts_compute_their_dequantized_weights(kind, num_tokens):
    """The CPU expert path over per-expert int8 / int4 weights against the same computation on their
    dequantized stacked weights: up to ``PACKED_MAX_TOKENS`` rows an expert runs the packed kernel (bfloat16
    activations: ``INT4_LINEAR_RTOL``), above it the dequantized weight in float32 (exact but for summation
    order)."""
    g = torch.Generator().manual_seed(num_tokens)
    E, H, inter, K = 8, 64, 96, 2
    w13, w2 = 0.1 * torch.randn(E, 2 * inter, H, generator=g), 0.1 * torch.randn(E, H, inter, generator=g)
    q13, q2 = [quantize_weight(w, kind) for w in w13], [quantize_weight(w, kind) for w in w2]
    deq13 = torch.stack([w.dequantize(torch.float32) for w in q13])
    deq2 = torch.stack([w.dequantize(torch.float32) for w in q2])
    hidden = torch.randn(num_tokens, H, generator=g)
    topk_weights, topk_ids = select_experts(torch.randn(num_tokens, E, generator=g), K, True)
    got = fused_moe_ref(hidden, q13, q2, topk_weights, topk_ids)
    want = fused_moe_ref(hidden, deq13, deq2, topk_weights, topk_ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < (INT4_LINEAR_RTOL if num_tokens * K / E <= PACKED_MAX_TOKENS else 1e-5), err


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantization_flag_quantizes_the_experts_and_keeps_the_routers(kind, tmp_path):
    """``--quantization int8|int4`` on a float MoE checkpoint (CPU): attention, experts and the LM head
    weight-only quantized from the float weights, routers float; it serves."""
    model_type, overrides = FLOAT_MODELS["qwen3moe"]
    float_dir = build_tiny_checkpoint(tmp_path / "f", model_type, seed=3, **overrides)
    llm = cpu_engine(float_dir, quantization=kind)
    model = llm.llm_engine.core.runner.model
    src = F.read_tensors(float_dir)
    weight_class = {"int8": Int8Weight, "int4": Int4Weight}[kind]
    for layer, moe in enumerate(experts_of(llm)):
        gate = model.model.layers[layer].mlp.gate
        assert gate.weight_q is None                                              # the router stays float
        assert torch.equal(gate.weight, src[f"model.layers.{layer}.mlp.gate.weight"])
        prefix = f"model.layers.{layer}.mlp.experts"
        for e, (w13, w2) in enumerate(zip(*moe.cpu_quantized)):
            float13 = torch.cat([src[f"{prefix}.{e}.gate_proj.weight"], src[f"{prefix}.{e}.up_proj.weight"]])
            assert isinstance(w13, weight_class) and torch.equal(w13.q, weight_class(float13).q)
            assert torch.equal(w2.q, weight_class(src[f"{prefix}.{e}.down_proj.weight"]).q)
    assert model.quantized_head is not None
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
