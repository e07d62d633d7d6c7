"""A vision-language model's language model on quantized weights: ``--quantization fp8`` on tiny LLaVA and
Qwen2-VL turns every language-model projection into an ``Fp8Weight`` (the vision side stays float) and an
image chat equals the same model with those FP8 weights dequantized (CPU runs them dequantized)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from tests.vision.conftest import build_tiny_llava, build_tiny_qwen2_vl, make_image


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_fp8_language_model_of_a_vision_model(family, tmp_path):
    path = (build_tiny_llava(tmp_path / family) if family == "llava" else build_tiny_qwen2_vl(tmp_path / family))
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": make_image(64, 48, seed=1)},
                                             {"type": "text", "text": "What is this?"}]}]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=512, quantization="fp8")
    model = llm.llm_engine.core.runner.model
    linears = [m for m in model.language_model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight_q, Fp8Weight) for m in linears)
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]

    ref = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=512)
    with torch.no_grad():   # the same FP8 round trip, kept as float weights
        for m in ref.llm_engine.core.runner.model.language_model.modules():
            if isinstance(m, Linear):
                m.weight.copy_(Fp8Weight.from_float(m.weight, torch.float32).dequantize(torch.float32))
    expect = ref.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expect.token_ids
    for a, b in zip(out.logprobs, expect.logprobs):
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in b)
