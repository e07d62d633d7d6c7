"""Weight-only int8 / int4 (``--quantization``): the quantizers' error bounds, both ``quantized_linear`` paths
against the dequantized weight, and an int8 engine against the float one (vLLM's rule: where greedy
sequences part, each token is in the other's top 5; int4 against float on the real SmolLM2 in
tests/models/test_smollm2.py), plus the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.quantized import (BF16_PRODUCTS_MIN_TOKENS, FP16_COPY_MAX_TOKENS, FP16_COPY_MIN_TOKENS,
                                     INT4_GROUP_SIZE, PACKED_MAX_TOKENS, Bf16ProductsWeight, Bf16Weight, Fp16Weight,
                                     Int4Weight, Int8Weight, QuantizedEmbedding, cpu_has_amx, float_copies_fit,
                                     kind_for_gguf_type, most_precise, packed_weights, quantized_linear)
from engine.layers.linear import Linear
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def _weight(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(48, 64) * torch.linspace(0.01, 3.0, 48)[:, None]     # rows of very different ranges


def test_int8_error_is_at_most_half_a_step():
    w = _weight(0)
    q = Int8Weight(w)
    assert q.q.dtype == torch.int8 and q.scales.shape == (48,) and int(q.q.abs().max()) == 127
    err = (q.dequantize(torch.float32) - w).abs()
    assert bool((err <= q.scales[:, None] / 2 + 1e-6).all())


def test_int4_error_is_at_most_half_a_step_per_group():
    w = _weight(1)
    q = Int4Weight(w)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15 and q.scales.shape == (48, 64 // INT4_GROUP_SIZE)
    err = (q.dequantize(torch.float32) - w).abs().view(48, -1, INT4_GROUP_SIZE)
    assert bool((err <= q.scales[..., None] / 2 + 1e-5).all())
    rows = torch.tensor([3, 0, 47])
    torch.testing.assert_close(q.dequantize(torch.float32, rows=rows), q.dequantize(torch.float32)[rows])


@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight, Fp16Weight])
@pytest.mark.parametrize("num_tokens", [1, 7, PACKED_MAX_TOKENS, PACKED_MAX_TOKENS + 1, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_the_dequantized_weight(kind, num_tokens, bias):
    torch.manual_seed(num_tokens)
    w, x = torch.randn(96, 64), torch.randn(num_tokens, 64)
    b = torch.randn(96) if bias else None
    q = kind(w)
    ref = F.linear(x, q.dequantize(torch.float32), b)
    out = quantized_linear(x, q, b)
    assert out.dtype == x.dtype and out.shape == ref.shape
    # The int8/int4 packed kernels (up to PACKED_MAX_TOKENS rows) take bfloat16 activations and scales;
    # fbgemm's fp16 GEMM (every row count) float32 activations.
    if kind is Fp16Weight:
        tol = 1e-5 * ref.abs().max() * 64
    else:
        tol = 3e-2 * ref.abs().max() if num_tokens <= PACKED_MAX_TOKENS else 1e-4
    torch.testing.assert_close(out, ref, atol=float(tol), rtol=0)


@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("num_tokens", [1, FP16_COPY_MIN_TOKENS - 1, FP16_COPY_MIN_TOKENS, BF16_PRODUCTS_MIN_TOKENS - 1,
                                        BF16_PRODUCTS_MIN_TOKENS, FP16_COPY_MAX_TOKENS + 1])
def test_float_copies_serve_steps_of_many_rows(kind, amx, num_tokens):
    """With ``keep_float_copies``, steps below ``FP16_COPY_MIN_TOKENS`` rows run the packed kernel. Without AMX
    the rest up to ``FP16_COPY_MAX_TOKENS`` run the float16 copy (within float16's rounding of the dequantized
    weight) and larger ones the dequantized weight itself; with AMX, the bf16 copy runs below
    ``BF16_PRODUCTS_MIN_TOKENS`` rows (within bf16's rounding) and the bf16-products copy from there, at every
    size."""
    torch.manual_seed(num_tokens)
    w, x, b = torch.randn(96, 64), torch.randn(num_tokens, 64), torch.randn(96)
    q = kind(w)
    assert q.fp16_copy is None and q.packed_max_tokens == PACKED_MAX_TOKENS
    q.keep_float_copies(amx)
    assert q.packed_max_tokens == FP16_COPY_MIN_TOKENS - 1
    assert q.nbytes_float_copies(amx) == (6 if amx else 2) * 96 * 64
    assert (q.fp16_copy is None) == amx and (q.bf16_copy is not None) == amx == (q.bf16_products_copy is not None)
    out = quantized_linear(x, q, b)
    ref = F.linear(x, q.dequantize(torch.float32), b)
    if num_tokens < FP16_COPY_MIN_TOKENS:
        torch.testing.assert_close(out, q.packed_mm(x).float() + b, atol=0, rtol=0)
    elif amx and num_tokens < BF16_PRODUCTS_MIN_TOKENS:
        torch.testing.assert_close(out, q.bf16_copy.packed_mm(x).float() + b, atol=0, rtol=0)
        torch.testing.assert_close(out, ref, atol=float(2e-2 * ref.abs().max()), rtol=0)
    elif amx:
        torch.testing.assert_close(out, q.bf16_products_copy.packed_mm(x) + b, atol=0, rtol=0)
    elif num_tokens > FP16_COPY_MAX_TOKENS:
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    else:
        torch.testing.assert_close(out, q.fp16_copy.packed_mm(x) + b, atol=0, rtol=0)
        torch.testing.assert_close(out, ref, atol=float(1e-5 * ref.abs().max() * 64), rtol=0)


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_bf16_copy_is_the_bf16_gemm(num_tokens):
    """``Bf16Weight`` (oneDNN-packed where torch has the op): bfloat16 out, equal to a bf16 ``F.linear`` on the
    rounded weight up to float32 summation order."""
    torch.manual_seed(num_tokens)
    w, x = torch.randn(80, 64), torch.randn(num_tokens, 64)
    out = Bf16Weight(w).packed_mm(x)
    ref = x.bfloat16().double() @ w.bfloat16().double().T
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 80)
    torch.testing.assert_close(out.double(), ref, atol=float(1e-5 * ref.abs().max()), rtol=2 ** -8)


@pytest.mark.parametrize("num_tokens", [1, 20, 300])
def test_bf16_products_stay_within_bf16_rounding_and_leave_float32_exact(num_tokens):
    """``Bf16ProductsWeight``: each product of bfloat16-rounded operands (relative error <= 2^-8), float32
    sums and output; the float32 matmul mode is restored, so float weights stay exact afterwards."""
    torch.manual_seed(num_tokens)
    w, x = torch.randn(96, 64) * torch.linspace(0.01, 3.0, 96)[:, None], torch.randn(num_tokens, 64) * 50
    before = torch.backends.mkldnn.matmul.fp32_precision
    out = Bf16ProductsWeight(w).packed_mm(x)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    ref = x.double() @ w.double().T
    bound = 2.0 ** -8 * (x.abs().double() @ w.abs().double().T) + 1e-5 * ref.abs().max()
    assert out.dtype == torch.float32 and bool(((out.double() - ref).abs() <= bound).all())
    exact = F.linear(x, w)                              # the float path after the call: float32's own GEMM
    torch.testing.assert_close(exact, (x.double() @ w.double().T).float(), atol=1e-3, rtol=1e-5)


def test_quantized_head_logits_are_float32_at_every_batch():
    """The LM head's logits come from its fp16 copy at every row count: float32, not the packed kernels'
    bfloat16 (whose steps of 1/16 at logits of 8-16 tie greedy choices)."""
    torch.manual_seed(0)
    head = QuantizedEmbedding(torch.randn(512, 64) * 0.5, "int8")
    hidden = torch.randn(3, 64) * 4
    packed = head.weight_q.packed_mm(hidden).float()
    assert bool((packed == packed.bfloat16().float()).all())            # what the packed kernel returns
    head.weight_q.keep_float_copies(amx=False)                              # what the builder keeps for a head
    logits = head.logits(hidden)
    assert logits.dtype == torch.float32 and bool((logits != logits.bfloat16().float()).any())
    torch.testing.assert_close(logits, head.weight_q.fp16_copy.packed_mm(hidden), atol=0, rtol=0)
    ref = F.linear(hidden, head.weight_q.dequantize(torch.float32))
    torch.testing.assert_close(logits, ref, atol=float(1e-5 * ref.abs().max() * 64), rtol=0)


def test_float_copies_follow_the_setting_and_the_memory_rule(tiny_llama_dir):
    from engine.models.builder import _amx_gemm, _keep_float_copies
    assert float_copies_fit(1 << 30, 4 << 30) and not float_copies_fit((1 << 30) + 1, 4 << 30)
    for wanted, kept in ((False, False), (None, True), (True, True)):
        llm = LLM(str(tiny_llama_dir), quantization="int4", cpu_float_copy=wanted, max_model_len=64)
        weights = packed_weights(llm.llm_engine.core.runner.model)
        assert weights and all((w.packed_max_tokens < PACKED_MAX_TOKENS) == kept for w in weights)
    model = llm.llm_engine.core.runner.model
    for w in weights:
        w.fp16_copy = w.bf16_copy = w.bf16_products_copy = w.amx_tiles = None
    _keep_float_copies(model, None, physical_bytes=1)    # a machine too small for them: none kept
    assert all(w.packed_max_tokens == PACKED_MAX_TOKENS for w in weights)
    _keep_float_copies(model, True, amx=True)            # the projections get AMX's, the head's logits stay float32
    head = model.quantized_head.weight_q
    assert head.fp16_copy is not None and head.bf16_copy is head.bf16_products_copy is None
    assert (head.amx_tiles is None) == (_amx_gemm() is None or not head.fits_amx_gemm(_amx_gemm()))
    # decode batches: the AMX tiles where this CPU grants AMX (kernels.cpu_amx_gemm), else a bf16 copy
    assert all(w.fp16_copy is None and (w.bf16_copy is None) != (w.amx_tiles is None)
               and w.bf16_products_copy is not None for w in weights if w is not head)


def test_fp16_embedding_looks_up_float16_rows():
    w = _weight(3)
    emb = QuantizedEmbedding(w, "fp16")
    torch.testing.assert_close(emb(torch.tensor([7, 0])), w[[7, 0]].half().float(), atol=0, rtol=0)
    hidden = torch.randn(2, w.shape[1])
    torch.testing.assert_close(emb.logits(hidden), hidden @ w.half().float().t(), atol=1e-3, rtol=1e-3)


def test_quantized_embedding_serves_lookups_and_the_head():
    w = _weight(2)
    emb = QuantizedEmbedding(w, "int4")
    torch.testing.assert_close(emb(torch.tensor([5, 5, 0])), emb.weight_q.dequantize(torch.float32)[[5, 5, 0]])
    hidden = torch.randn(3, 64)
    ref = hidden @ emb.weight_q.dequantize(torch.float32).t()
    torch.testing.assert_close(emb.logits(hidden), ref, atol=float(3e-2 * ref.abs().max()), rtol=0)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp16"])
def test_quantized_engine_runs_every_projection_quantized(tiny_llama_dir, kind):
    prompts = ["The quick brown fox", "Hello world, this is", "One two three four five six seven"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    ref = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", quantization=kind)
    linears = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight_q is not None and m.weight is None for m in linears)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, outs):
        assert len(b.outputs[0].token_ids) == 12
        if kind == "int4":
            continue   # this random model's top tokens lie within 0.3 nats: int4 is checked on SmolLM2
        for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            if x != y:    # parted: each side's token is in the other's top 5 (vLLM's rule)
                assert x in b.outputs[0].logprobs[i] and y in a.outputs[0].logprobs[i]
                break


def test_quantization_refuses_what_it_does_not_support(tiny_llama_dir):
    with pytest.raises(ValueError, match="use 'int8', 'int4' or 'fp16'"):
        LLM(model=str(tiny_llama_dir), device="cpu", quantization="fp4")


@pytest.mark.parametrize("gguf_type, kind", [("F32", None), ("F16", None), ("BF16", None), ("Q4_0", "int4"),
                                             ("Q4_1", "int4"), ("Q4_K", "int4"), ("IQ4_XS", "int4"),
                                             ("Q3_K", "int4"), ("Q5_1", "int8"), ("Q6_K", "int8"),
                                             ("Q8_0", "int8")])
def test_gguf_types_keep_their_precision(gguf_type, kind):
    assert kind_for_gguf_type(gguf_type) == kind


def test_a_plan_quantizes_each_projection_as_its_most_precise_part(tiny_llama_dir):
    """A GGUF-style plan (tensor name -> kind): q/k/v packed into one projection take the most precise
    kind of the three; a float part keeps the projection float; the tied head follows the embedding."""
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", quantization="none")
    model = llm.llm_engine.core.runner.model
    layers = model.model.layers
    plan = {}
    for i in range(len(layers)):
        prefix = f"model.layers.{i}."
        plan.update({prefix + f"self_attn.{p}_proj.weight": "int4" for p in "qkvo"})
        plan.update({prefix + f"mlp.{p}_proj.weight": "int4" for p in ("gate", "up", "down")})
    plan["model.layers.0.self_attn.v_proj.weight"] = "int8"
    plan["model.layers.0.mlp.up_proj.weight"] = None
    head = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    plan[head] = "int8"
    model.quantize(plan)
    assert isinstance(layers[0].self_attn.qkv_proj.weight_q, Int8Weight)
    assert layers[0].mlp.gate_up_proj.weight_q is None and layers[0].mlp.gate_up_proj.weight is not None
    assert isinstance(layers[0].self_attn.o_proj.weight_q, Int4Weight)
    assert isinstance(layers[1].self_attn.qkv_proj.weight_q, Int4Weight)
    assert isinstance(model.quantized_head.weight_q, Int8Weight)
    assert most_precise(["int4", "int8"]) == "int8" and most_precise(["int4", None]) is None


def test_bf16_matmul_mode_is_held_under_one_lock(tiny_llama_dir):
    """oneDNN's matmul mode is process-wide: a bf16-products GEMM waits while another holder has the lock, and
    a CPU runner of float weights holds it through each step (a bf16-weights runner never does: its own
    GEMMs take it), so a float engine beside a quantized one in one process never runs in bf16 mode."""
    import threading

    from engine.layers.quantized import BF16_MATMUL_MODE_LOCK
    done = threading.Event()
    weight = Bf16ProductsWeight(torch.randn(8, 16))
    with BF16_MATMUL_MODE_LOCK:
        worker = threading.Thread(target=lambda: (weight.packed_mm(torch.randn(2, 16)), done.set()))
        worker.start()
        assert not done.wait(0.3)
    worker.join(10)
    assert done.is_set() and not BF16_MATMUL_MODE_LOCK.locked()

    for quantization in ("none", "int4"):
        llm = LLM(str(tiny_llama_dir), quantization=quantization, max_model_len=64)
        runner = llm.llm_engine.core.runner
        model = runner.model
        held = []
        forward = model.forward

        def spy(*args, **kwargs):
            held.append(BF16_MATMUL_MODE_LOCK.locked())
            return forward(*args, **kwargs)
        model.forward = spy
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert held and all(h == (not runner.bf16_weights) for h in held)
        assert runner.bf16_weights == (quantization == "int4" and cpu_has_amx())
