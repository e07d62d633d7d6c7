"""Weight-only int8 (``--quantization int8``): the quantizer's error bound, both ``int8_linear`` paths against
the dequantized weight, and an int8 engine against the float one (vLLM's rule: where greedy sequences part,
each token is in the other's top 5), plus the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.quantized import PACKED_MAX_TOKENS, dequantize_int8, int8_linear, quantize_int8
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def test_quantize_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.linspace(0.01, 3.0, 48)[:, None]     # rows of very different ranges
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    err = (dequantize_int8(q, scales, torch.float32) - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-6).all())
    assert int(q.abs().max()) == 127


@pytest.mark.parametrize("num_tokens", [1, 7, PACKED_MAX_TOKENS, PACKED_MAX_TOKENS + 1, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_dequantized_weight(num_tokens, bias):
    torch.manual_seed(num_tokens)
    w, x = torch.randn(96, 64), torch.randn(num_tokens, 64)
    b = torch.randn(96) if bias else None
    q, scales = quantize_int8(w)
    ref = F.linear(x, dequantize_int8(q, scales, torch.float32), b)
    out = int8_linear(x, q, scales, scales.to(torch.bfloat16), b)
    assert out.dtype == x.dtype and out.shape == ref.shape
    # The packed kernel (up to PACKED_MAX_TOKENS rows) takes bfloat16 activations and scales.
    tol = 3e-2 * ref.abs().max() if num_tokens <= PACKED_MAX_TOKENS else 1e-4
    torch.testing.assert_close(out, ref, atol=float(tol), rtol=0)


def test_int8_engine_follows_the_float_engine(tiny_llama_dir):
    prompts = ["The quick brown fox", "Hello world, this is", "One two three four five six seven"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    ref = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", quantization="int8")
    assert all(m.int8 is not None for m in llm.llm_engine.core.runner.model.modules() if hasattr(m, "int8"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:    # parted: each side's token is in the other's top 5, then the sequences differ
                assert x in b.outputs[0].logprobs[i] and y in a.outputs[0].logprobs[i]
                break


def test_int8_refuses_what_it_does_not_support(tiny_llama_dir):
    with pytest.raises(ValueError, match="with LoRA adapters is not supported"):
        LLM(model=str(tiny_llama_dir), device="cpu", quantization="int8", enable_lora=True)
    with pytest.raises(ValueError, match="use 'int8'"):
        LLM(model=str(tiny_llama_dir), device="cpu", quantization="int4")
