"""``--quantization fp8``: every projection becomes an ``Fp8Weight`` (per-channel scales, amax / 448) and the
model runs on those weights; adapters run on top. On CPU the FP8 weight runs dequantized, so the engine
must equal the float engine on the same dequantized weights, and transformers + PEFT on them, exactly
(float32)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from lora import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model

PROMPTS = ["The quick brown fox", "Hello world, this is"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=3)


@pytest.fixture(scope="module")
def fp8_dequantized_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny model with each projection's weight replaced by its FP8 round trip."""
    out = tmp_path_factory.mktemp("fp8-dequantized")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            weights[name] = Fp8Weight.from_float(w, torch.float32).dequantize(torch.float32)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_every_projection_is_fp8_and_equals_its_dequantized_weights(tiny_llama_dir, fp8_dequantized_dir):
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", quantization="fp8", max_model_len=128)
    linears = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight_q, Fp8Weight) and m.weight is None for m in linears)
    ref = LLM(model=str(fp8_dequantized_dir), device="cpu", dtype="float32", max_model_len=128)
    for a, b in zip(llm.generate(PROMPTS, GREEDY, use_tqdm=False), ref.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in y)


def test_adapters_on_an_fp8_base_equal_peft_on_its_weights(tiny_llama_dir, fp8_dequantized_dir, tmp_path):
    adapter = build_peft_adapter(tiny_llama_dir, tmp_path / "a", r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                 seed=3)
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", quantization="fp8", max_model_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    pm = peft_reference_model(fp8_dequantized_dir, {"a": adapter})
    tok = llm.get_tokenizer()
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), lora_request=lora, use_tqdm=False)
    base = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for prompt, out, plain in zip(PROMPTS, outs, base):
        ids = tok.encode(prompt)
        assert list(out.outputs[0].token_ids) == peft_greedy(pm, "a", ids, 8).token_ids
        assert list(plain.outputs[0].token_ids) == peft_greedy(pm, None, ids, 8).token_ids
