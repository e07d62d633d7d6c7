"""Adapters on a weight-only quantized CPU base (``--quantization int8|int4`` with ``--enable-lora``): every
projection and the LM head keep their packed int8 / int4 weights and each adapter runs beside them. The
reference is transformers + PEFT on the checkpoint with those weights dequantized (int8 per row, int4 per
group of 32 inputs: row-wise, so quantizing a packed q/k/v is quantizing each part). With the packed kernels
replaced by their dequantized weights in float32, tokens are PEFT's and logprobs within 1e-4 (the adapter math
beside a quantized base is exact); with the kernels themselves (bfloat16 activations), vLLM's top-5 rule."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.quantized import QuantizedEmbedding, _PackedWeight, quantize_weight
from lora import LoRARequest
from tests.conftest import build_tiny_checkpoint
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.quantization.test_checkpoints import EXACT_ATOL, INT4_ATOL

MAX_TOKENS = 8
PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache in fixed-size blocks."]


def _dequantized_reference(model_dir: Path, out_dir: Path, kind: str) -> Path:
    """``model_dir`` with every projection and the LM head (or the tied embedding) as the engine holds
    them."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    for name, w in tensors.items():
        if name.endswith("_proj.weight") or name == head:
            tensors[name] = quantize_weight(w.float(), kind).dequantize(torch.float32)
    shutil.copytree(model_dir, out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _exact_packed_linear(self, x, bias=None):
    """``_PackedWeight.linear`` on its dequantized weight in float32 (the packed kernels' bfloat16 aside)."""
    return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)


def _exact_logits(self, hidden):
    return hidden @ self.weight_q.dequantize(hidden.dtype).T


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_adapters_on_a_weight_only_quantized_base_match_peft_on_its_weights(kind, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    model_dir = build_tiny_checkpoint(tmp_path / "m", "llama", seed=1)
    reference = _dequantized_reference(model_dir, tmp_path / "ref", kind)
    adapter = build_peft_adapter(reference, tmp_path / "a", r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                 seed=3)
    tok = AutoTokenizer.from_pretrained(reference)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    pm = peft_reference_model(reference, {"a": adapter})
    refs = [peft_greedy(pm, which, ids, MAX_TOKENS) for which in ("a", None) for ids in prompt_ids]
    assert refs[0].token_ids != refs[2].token_ids                                    # the adapter acts
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    lora = LoRARequest("a", 1, str(adapter))

    def run() -> list:
        llm = LLM(model=str(model_dir), device="cpu", dtype="float32", quantization=kind, enable_lora=True,
                  max_loras=1, max_lora_rank=8, max_model_len=128, seed=0)
        model = llm.llm_engine.core.runner.model
        assert model.quantized_head is not None and all(
            m.weight_q is not None for n, m in model.named_modules() if n.endswith(("qkv_proj", "down_proj")))
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids] * 2, params,
                            lora_request=[lora] * len(prompt_ids) + [None] * len(prompt_ids), use_tqdm=False)
        return [ours_as_ref(o.outputs[0]) for o in outs]

    for i, (ref, ours) in enumerate(zip(refs, run())):
        check_logprobs_close(ref, ours, f"{kind} request {i}", atol=INT4_ATOL)
    monkeypatch.setattr(_PackedWeight, "linear", _exact_packed_linear)
    monkeypatch.setattr(QuantizedEmbedding, "logits", _exact_logits)
    for i, (ref, ours) in enumerate(zip(refs, run())):
        assert ours.token_ids == ref.token_ids, f"{kind} request {i} (kernels on the dequantized weights)"
        check_logprobs_close(ref, ours, f"{kind} request {i} (exact)", atol=EXACT_ATOL)
