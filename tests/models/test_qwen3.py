"""Qwen3 (dense) against transformers on tiny random checkpoints (CPU, float32, vLLM's rule: greedy tokens
equal or, where they part, each in the other's top-5; logprobs within 1e-3):

- head_dim 32 != hidden 64 / 4 heads, 2 KV heads; untied LM head, and tied embeddings with attention_bias;
  random q_norm / k_norm / layer norm weights (transformers initializes them to ones, which would hide a
  norm read from the wrong place);
- chunked prefill and prefix caching on a long prompt;
- a PEFT adapter on all seven projections equals PEFT (the q/k/v update is added before the q/k norms);
- ``--quantization fp8``: every projection an ``Fp8Weight``, equal to transformers on the FP8 round-trip
  weights;
- tensor_parallel_size 2 equals 1 (with an adapter).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.adapter import Feeds
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from lora import LoRARequest
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import check_outputs_close, hf_float32, hf_greedy, ours_as_ref

MAX_TOKENS = 10
SHAPE = dict(hidden_size=64, num_attention_heads=4, head_dim=32, num_key_value_heads=2, intermediate_size=128)
LONG_PROMPT = " ".join(TINY_PROMPTS) + " " + " ".join(TINY_PROMPTS[::-1])


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def _randomize_norms(model_dir: Path, seed: int) -> None:
    """Every RMSNorm weight (q_norm, k_norm, the layer and final norms) drawn from U(0.5, 1.5)."""
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = 0.5 + torch.rand(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, path, metadata={"format": "pt"})


def _build(out_dir: Path, seed: int, **overrides) -> Path:
    build_tiny_checkpoint(out_dir, "qwen3", seed=seed, **SHAPE, **overrides)
    _randomize_norms(out_dir, seed)
    return out_dir


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-qwen3")
    return {"untied": _build(root / "untied", seed=5),
            "tied": _build(root / "tied", seed=6, tie_word_embeddings=True, attention_bias=True)}



@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_parity_with_transformers(qwen3_dirs, variant):
    d = qwen3_dirs[variant]
    hf = hf_float32(d)
    assert hf.config.head_dim * hf.config.num_attention_heads != hf.config.hidden_size
    assert hf.config.tie_word_embeddings == (variant == "tied")
    llm = LLM(str(d), seed=0, max_model_len=256)
    model = llm.llm_engine.core.runner.model
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (model.lm_head is None) == (variant == "tied")
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (32,)
        assert tuple(attn.qkv_proj.weight.shape) == (4 * 32 + 2 * 2 * 32, 64)
        assert (attn.qkv_proj.bias is not None) == (attn.o_proj.bias is not None) == (variant == "tied")
        # The q/k norms read the projection's output: an adapter update never waits for the rotary write.
        assert attn.qkv_proj.feeds is Feeds.ANY
    assert model.lora_qkv_warmup_consumer() is None
    tok = llm.get_tokenizer()
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in TINY_PROMPTS]
    outputs = llm.generate(TINY_PROMPTS, _params(), use_tqdm=False)
    exact = check_outputs_close(outputs, refs, [f"{variant} prompt {i}" for i in range(len(refs))])
    assert exact >= len(refs) - 2
    assert len({tuple(r.token_ids) for r in refs}) > 1


def test_chunked_prefill_and_prefix_caching_on_a_long_prompt(qwen3_dirs):
    d = qwen3_dirs["untied"]
    llm = LLM(str(d), seed=0, max_model_len=512, enable_prefix_caching=True, max_num_batched_tokens=32,
              max_num_seqs=4, block_size=16)
    tok = llm.get_tokenizer()
    prompts = [LONG_PROMPT, LONG_PROMPT + " The quick brown fox"]
    ids = [tok.encode(p) for p in prompts]
    assert len(ids[0]) > 3 * 32                       # several prefill chunks
    hf = hf_float32(d)
    refs = [hf_greedy(hf, i, MAX_TOKENS) for i in ids]
    first = llm.generate(prompts[:1], _params(), use_tqdm=False)
    second = llm.generate(prompts[1:], _params(), use_tqdm=False)
    check_outputs_close(first + second, refs, ["long prompt", "long prompt + tail (cached prefix)"])
    assert second[0].num_cached_tokens >= 16 * (len(ids[0]) // 16 - 1)
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


def test_peft_adapter_on_all_seven_projections(qwen3_dirs, tmp_path):
    d = qwen3_dirs["untied"]
    path = build_peft_adapter(d, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=ALL_TARGETS, seed=7)
    pm = peft_reference_model(d, {"a": path})
    llm = LLM(str(d), seed=0, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    tok = llm.get_tokenizer()
    prompts = TINY_PROMPTS[:4]
    adapters = ["a", None, "a", "a"]        # the base model in the same batch
    refs = [peft_greedy(pm, a, tok.encode(p), MAX_TOKENS) for p, a in zip(prompts, adapters)]
    lora = LoRARequest("a", 1, str(path))
    outputs = llm.generate(prompts, _params(), lora_request=[lora if a else None for a in adapters],
                           use_tqdm=False)
    exact = check_outputs_close(outputs, refs, [f"prompt {i} ({a})" for i, a in enumerate(adapters)])
    assert exact >= 3
    assert refs[0].token_ids != peft_greedy(pm, None, tok.encode(prompts[0]), MAX_TOKENS).token_ids


def test_fp8_every_projection_and_parity_on_its_weights(qwen3_dirs, tmp_path):
    d = qwen3_dirs["untied"]
    llm = LLM(str(d), seed=0, max_model_len=128, quantization="fp8")
    model = llm.llm_engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 and all(isinstance(m.weight_q, Fp8Weight) and m.weight is None for m in linears)
    rounded = tmp_path / "fp8-rounded"
    shutil.copytree(d, rounded)
    weights = load_file(rounded / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            weights[name] = Fp8Weight.from_float(w, torch.float32).dequantize(torch.float32)
    save_file(weights, rounded / "model.safetensors", metadata={"format": "pt"})
    hf = hf_float32(rounded)
    tok = llm.get_tokenizer()
    prompts = TINY_PROMPTS[:3]
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in prompts]
    check_outputs_close(llm.generate(prompts, _params(), use_tqdm=False), refs, [f"fp8 prompt {i}" for i in range(3)])


def test_tensor_parallel_2_equals_1(qwen3_dirs, tmp_path):
    """Size 2 (gloo, float32): KV heads split one per rank, q_norm / k_norm whole on each, o_proj's bias
    (attention_bias) once; with an adapter on all seven projections next to base-model requests."""
    d = qwen3_dirs["tied"]
    path = build_peft_adapter(d, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=ALL_TARGETS, seed=8)
    prompts = TINY_PROMPTS[:4] * 2
    loras = [None] * 4 + [LoRARequest("a", 1, str(path))] * 4
    outs = []
    for size in (1, 2):
        llm = LLM(str(d), tensor_parallel_size=size, device="cpu", dtype="float32", max_model_len=256, seed=0,
                  enable_lora=True, max_loras=2, max_lora_rank=8)
        try:
            outs.append(llm.generate(prompts, _params(8), lora_request=loras, use_tqdm=False))
        finally:
            llm.llm_engine.core.shutdown()
    exact = check_outputs_close(outs[1], [ours_as_ref(o.outputs[0]) for o in outs[0]],
                                [f"tp2 request {i}" for i in range(8)])
    assert exact >= 7


def test_model_type_fallback():
    """A config built in code (no ``architectures``) finds its class by model_type. Sliding-window configs:
    tests/models/test_sliding_window.py."""
    from transformers import Qwen3Config

    from engine.models.qwen3 import Qwen3ForCausalLM
    from engine.models.registry import get_model_class

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    assert get_model_class(Qwen3Config(**tiny)) is Qwen3ForCausalLM
