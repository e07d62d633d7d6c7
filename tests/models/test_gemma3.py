"""Gemma 3 (text-only ``Gemma3ForCausalLM``) against transformers on tiny random checkpoints (CPU, float32,
vLLM's rule: greedy tokens equal or, where they part, each in the other's top-5; logprobs within 1e-3):

- hidden 64, 4 heads of head_dim 16, 1 or 2 KV heads, 4 layers interleaving sliding-window and global layers
  (``sliding_window_pattern`` and explicit ``layer_types``), the window larger than every test context;
  ``query_pre_attn_scalar`` != head_dim; local and global rope bases, the global one linearly scaled;
  ``final_logit_softcapping``; tied embeddings, and an untied variant;
- random weights for every RMSNorm (transformers initializes Gemma's to zeros, i.e. a scale of 1 + 0,
  which would hide a missing ``1 + w``);
- chunked prefill and prefix caching on a long prompt; prefill chunks beside decode rows;
- a PEFT adapter on all seven projections equals PEFT; tensor_parallel_size 2 equals 1;
- attention-logit soft-capping and bidirectional attention are refused (contexts past the sliding window:
  tests/models/test_sliding_window.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from lora import LoRARequest
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import check_outputs_close, hf_float32, hf_greedy, ours_as_ref

MAX_TOKENS = 16
WINDOW = 512
SHAPE = dict(hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=128, num_hidden_layers=4,
             sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
LONG_PROMPT = " ".join(TINY_PROMPTS) + " " + " ".join(TINY_PROMPTS[::-1])
SLIDING, FULL = "sliding_attention", "full_attention"


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def _randomize_norms(model_dir: Path, seed: int) -> None:
    """Every RMSNorm weight w (q_norm, k_norm, the four layer norms, the final norm) drawn from U(-0.5, 0.5):
    Gemma scales by 1 + w."""
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.rand(w.shape, generator=gen, dtype=w.dtype) - 0.5
    save_file(weights, path, metadata={"format": "pt"})


def _build(out_dir: Path, seed: int, **overrides) -> Path:
    build_tiny_checkpoint(out_dir, "gemma3_text", seed=seed, **{**SHAPE, **overrides})
    _randomize_norms(out_dir, seed)
    return out_dir


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gemma3")
    return {"tied": _build(root / "tied", seed=11, num_key_value_heads=1, sliding_window_pattern=2),
            "untied": _build(root / "untied", seed=12, num_key_value_heads=2, tie_word_embeddings=False,
                             layer_types=[SLIDING, SLIDING, FULL, SLIDING])}



@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_parity_with_transformers(gemma3_dirs, variant):
    d = gemma3_dirs[variant]
    hf = hf_float32(d)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert hf.config.tie_word_embeddings == (variant == "tied")
    expected_types = ([SLIDING, FULL, SLIDING, FULL] if variant == "tied"
                      else [SLIDING, SLIDING, FULL, SLIDING])
    assert hf.config.layer_types == expected_types
    llm = LLM(str(d), seed=0, max_model_len=WINDOW)
    model = llm.llm_engine.core.runner.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (model.lm_head is None) == (variant == "tied")
    assert [layer.layer_type for layer in model.model.layers] == expected_types
    # Each kind's layers share one rotary; the kinds' differ (local base 1e4; global 1e6, linear x2).
    local = model.model.layers[0].self_attn.rotary_emb
    glob = model.model.layers[expected_types.index(FULL)].self_attn.rotary_emb
    assert local is not glob
    assert not torch.allclose(local.cos[1:], glob.cos[1:])
    for layer, kind in zip(model.model.layers, expected_types):
        assert layer.self_attn.rotary_emb is (local if kind == SLIDING else glob)
        assert layer.self_attn.attn.scale == pytest.approx(24 ** -0.5)
    # The norms hold 1 + w (the checkpoint's w are in [-0.5, 0.5]).
    hf_norm = hf.model.layers[0].post_feedforward_layernorm.weight
    torch.testing.assert_close(model.model.layers[0].post_feedforward_layernorm.weight, 1 + hf_norm)
    tok = llm.get_tokenizer()
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in TINY_PROMPTS]
    outputs = llm.generate(TINY_PROMPTS, _params(), use_tqdm=False)
    exact = check_outputs_close(outputs, refs, [f"{variant} prompt {i}" for i in range(len(refs))])
    assert exact >= len(refs) - 2
    assert len({tuple(r.token_ids) for r in refs}) > 1


def test_final_logit_softcapping_applies(gemma3_dirs):
    """The logits are capped at +-final_logit_softcapping, as transformers' are."""
    d = gemma3_dirs["tied"]
    hf = hf_float32(d)
    ids = torch.tensor([[2, 10, 11, 12, 13]])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert ref.abs().max() < 5.0
    llm = LLM(str(d), seed=0, max_model_len=64)
    model = llm.llm_engine.core.runner.model
    hidden = torch.randn(3, 64) * 100
    logits = model.compute_logits(hidden)
    assert logits.abs().max() <= 5.0
    raw = hidden @ model.model.embed_tokens.weight.t()
    torch.testing.assert_close(logits, torch.tanh(raw / 5.0) * 5.0)


def test_chunked_prefill_and_prefix_caching_on_a_long_prompt(gemma3_dirs):
    d = gemma3_dirs["untied"]
    llm = LLM(str(d), seed=0, max_model_len=WINDOW, enable_prefix_caching=True, max_num_batched_tokens=32,
              max_num_seqs=4, block_size=16)
    tok = llm.get_tokenizer()
    prompts = [LONG_PROMPT, LONG_PROMPT + " The quick brown fox"]
    ids = [tok.encode(p) for p in prompts]
    assert len(ids[0]) > 3 * 32                       # several prefill chunks
    assert len(ids[1]) + MAX_TOKENS <= WINDOW         # within the window: sliding layers are exact
    hf = hf_float32(d)
    refs = [hf_greedy(hf, i, MAX_TOKENS) for i in ids]
    first = llm.generate(prompts[:1], _params(), use_tqdm=False)
    second = llm.generate(prompts[1:], _params(), use_tqdm=False)
    check_outputs_close(first + second, refs, ["long prompt", "long prompt + tail (cached prefix)"])
    assert second[0].num_cached_tokens >= 16 * (len(ids[0]) // 16 - 1)
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


def test_batched_mixed_prefill_and_decode(gemma3_dirs):
    """Prompts of different lengths sharing steps (small token budget): decode rows beside prefill chunks."""
    d = gemma3_dirs["tied"]
    llm = LLM(str(d), seed=0, max_model_len=WINDOW, max_num_batched_tokens=16, max_num_seqs=8, block_size=16)
    tok = llm.get_tokenizer()
    hf = hf_float32(d)
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in TINY_PROMPTS]
    outputs = llm.generate(TINY_PROMPTS, _params(), use_tqdm=False)
    exact = check_outputs_close(outputs, refs, [f"mixed prompt {i}" for i in range(len(refs))])
    assert exact >= len(refs) - 2


def test_peft_adapter_on_all_seven_projections(gemma3_dirs, tmp_path):
    """The q/k/v update lands before the q/k norms, o's and down's before the post-norms (``Feeds.ANY``)."""
    d = gemma3_dirs["untied"]
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


def test_tensor_parallel_2_equals_1(gemma3_dirs):
    """Size 2 (gloo, float32): one KV head per rank, the norms whole on each, the scaled embedding and
    soft-capped logits over the vocabulary split."""
    d = gemma3_dirs["untied"]
    outs = []
    for size in (1, 2):
        llm = LLM(str(d), tensor_parallel_size=size, device="cpu", dtype="float32", max_model_len=256, seed=0)
        try:
            outs.append(llm.generate(TINY_PROMPTS[:4], _params(8), use_tqdm=False))
        finally:
            llm.llm_engine.core.shutdown()
    refs = [ours_as_ref(o.outputs[0]) for o in outs[0]]
    exact = check_outputs_close(outs[1], refs, [f"tp2 request {i}" for i in range(4)])
    assert exact >= 3


def test_unsupported_configs_are_refused():
    from transformers import Gemma3TextConfig

    from engine.models.gemma3 import Gemma3ForCausalLM
    from engine.models.registry import get_model_class

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                sliding_window_pattern=2)
    cfg = Gemma3TextConfig(**tiny, sliding_window=64)
    assert get_model_class(cfg) is Gemma3ForCausalLM                # model_type fallback (gemma3_text)
    # Contexts past the window are served: sliding layers attend within it, global layers to everything.
    model = Gemma3ForCausalLM(cfg, max_position=256)
    assert [a.sliding_window for a in model.attention_layers()] == [64, None]
    only_global = Gemma3ForCausalLM(Gemma3TextConfig(**{**tiny, "sliding_window_pattern": 1}, sliding_window=64),
                                    max_position=256)
    assert [a.sliding_window for a in only_global.attention_layers()] == [None, None]
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3ForCausalLM(Gemma3TextConfig(**tiny, sliding_window=64, attn_logit_softcapping=50.0),
                          max_position=64)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(Gemma3TextConfig(**tiny, sliding_window=64, use_bidirectional_attention=True),
                          max_position=32)
