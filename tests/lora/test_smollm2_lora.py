"""The real SmolLM2-135M-Instruct (the default model) with a PEFT adapter against transformers + PEFT on the
GGUF's float weights: exact with ``--quantization none``; by vLLM's top-5 rule with the engine's default, the
GGUF's own quantized weights (Q4_1 projections as int4, the Q8_0 head as int8) with the adapter beside them."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from lora import LoRARequest
from tests.lora.utils import build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.quantization.test_checkpoints import INT4_ATOL

MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", None])
def test_smollm2_with_adapter_matches_peft(quantization, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.layers.quantized import Int4Weight, Int8Weight
    from engine.loader import checkpoint_dir, resolve_model

    hf_dir = checkpoint_dir(resolve_model(None))      # the GGUF's cached HF conversion
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    adapter = build_peft_adapter(hf_dir, tmp_path / "smol-r8", r=8, lora_alpha=16,
                                 target_modules=["q_proj", "v_proj", "down_proj"], seed=0, base_model=base)
    pm = peft_reference_model(hf_dir, {"smol": adapter}, base_model=base)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    lora = LoRARequest("smol", 1, str(adapter))
    llm = LLM(None, enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=256, quantization=quantization)
    model = llm.llm_engine.core.runner.model
    if quantization is None:              # the GGUF's quantized tensors stay quantized under the adapter
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.weight_q, Int4Weight)
        assert isinstance(model.quantized_head.weight_q, Int8Weight)
    else:
        assert model.quantized_head is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    # Both prompts with the adapter and without, in one call.
    outs = llm.generate(PROMPTS * 2, params, lora_request=[lora, lora, None, None], use_tqdm=False)
    for i, out in enumerate(outs):
        adapter_name = "smol" if i < 2 else None
        ids = tok.encode(PROMPTS[i % 2])
        assert list(out.prompt_token_ids) == ids
        ref = peft_greedy(pm, adapter_name, ids, MAX_TOKENS)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"{adapter_name} / {PROMPTS[i % 2]}",
                             atol=1e-3 if quantization == "none" else INT4_ATOL)
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids   # the adapter matters
