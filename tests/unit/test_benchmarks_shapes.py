"""benchmarks/shapes.py: each shape's tiny variant loads in transformers and in Chorus (dummy weights) and
decodes; the decode-step bytes (latency.py's floor) against transformers' parameter count and hand-computed
cases (MoE expected experts, FP8 projections, sliding-window KV)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.shapes import (SHAPES, decode_bytes, dummy_model, expected_distinct_experts, kv_elem_bytes,
                               shape_fields)

ARCHITECTURES = {"llama3-8b": "LlamaForCausalLM", "llama3-70b": "LlamaForCausalLM", "qwen3-8b": "Qwen3ForCausalLM",
                 "qwen3-30b-a3b": "Qwen3MoeForCausalLM", "gemma3-12b": "Gemma3ForCausalLM"}


def _config(name: str):
    """The full-size shape's config (no directory, no tokenizer)."""
    model_type, arch, fields = shape_fields(name)
    return AutoConfig.for_model(model_type, **fields, architectures=[arch])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tiny_shape_loads_in_transformers_and_chorus_and_decodes(name, tmp_path, monkeypatch):
    """The tiny checkpoint is the shape's architecture in both; with every expert read (a huge batch) the
    weight bytes are transformers' parameters but the embedding (plus its B rows), the LM head counted once
    when tied; Chorus builds the same class from dummy weights and decodes the tokens asked for."""
    from engine import LLM, SamplingParams
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    model_dir = dummy_model(name, tiny=True)
    assert model_dir.startswith(str(tmp_path))
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == [ARCHITECTURES[name]]
    hf = AutoModelForCausalLM.from_config(cfg)
    assert type(hf).__name__ == ARCHITECTURES[name]
    params = sum(p.numel() for p in hf.parameters())
    embed = 0 if cfg.tie_word_embeddings else hf.get_input_embeddings().weight.numel()
    batch = 10 ** 6
    assert decode_bytes(cfg, batch, 8, 4)["weight_bytes"] == (params - embed + batch * cfg.hidden_size) * 4
    llm = LLM(model_dir, load_format="dummy", max_model_len=64, seed=0)
    assert type(llm.llm_engine.runner.model).__name__ == ARCHITECTURES[name]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert all(0 <= t < cfg.vocab_size for t in out[0].outputs[0].token_ids)


def test_expected_distinct_experts_under_uniform_routing():
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(128, 8, 2) == pytest.approx(15.5)     # 128 * (1 - (15/16)^2)
    assert expected_distinct_experts(128, 8, 64) == pytest.approx(128 * (1 - (15 / 16) ** 64))
    assert 125.9 < expected_distinct_experts(128, 8, 64) < 126.0
    assert expected_distinct_experts(128, 8, 10 ** 4) == pytest.approx(128.0)


def test_qwen3_30b_a3b_step_reads_attention_router_and_the_selected_experts():
    """Batch 1 at 512 tokens, bf16: per layer q|k|v 2048 x (4096 + 2 * 512), o 4096 x 2048, q/k norms 2 x 128,
    2 layer norms, router 2048 x 128, 8 experts of 3 x 2048 x 768; then the final norm, the LM head and one
    embedding row; KV 48 layers x 2 x 4 heads x 128 x 512 tokens."""
    attention = 2048 * 5120 + 4096 * 2048 + 2 * 128 + 2 * 2048
    layer = attention + 2048 * 128 + 8 * 3 * 2048 * 768
    weights = 2 * (48 * layer + 2048 + 151936 * 2048 + 2048)
    fb = decode_bytes(_config("qwen3-30b-a3b"), 1, 512)
    assert fb["weight_bytes"] == weights == 6_083_739_648
    assert fb["kv_bytes"] == 48 * 2 * 4 * 128 * 512 * 2
    assert fb["experts_read_per_layer"] == pytest.approx(8.0)
    fb2 = decode_bytes(_config("qwen3-30b-a3b"), 2, 512)                 # 15.5 experts, 2 embedding rows
    assert fb2["weight_bytes"] == weights + 2 * (48 * 7.5 * 3 * 2048 * 768 + 2048)


def test_fp8_projections_count_one_byte_per_weight_and_a_scale_per_channel():
    """Llama-3-8B at batch 1: each projection in x out + 4 bytes per output; norms, LM head, embedding bf16."""
    def proj(d_in, d_out):
        return d_in * d_out + 4 * d_out
    layer = proj(4096, 6144) + proj(4096, 4096) + proj(4096, 2 * 14336) + proj(14336, 4096) + 2 * 2 * 4096
    cfg = _config("llama3-8b")
    fb = decode_bytes(cfg, 1, 100, fp8=True)
    assert fb["weight_bytes"] == 32 * layer + 2 * (4096 + 128256 * 4096 + 4096)
    assert fb["kv_bytes"] == decode_bytes(cfg, 1, 100)["kv_bytes"]          # the KV cache stays bf16
    bf16 = decode_bytes(cfg, 1, 100)["weight_bytes"]
    assert 0.5 < (fb["weight_bytes"] - 2 * 128256 * 4096) / (bf16 - 2 * 128256 * 4096) < 0.51


def test_gemma3_sliding_layers_read_at_most_the_window():
    """40 sliding layers (window 1024) and 8 global ones; 8 KV heads of 256, bf16, per sequence."""
    cfg = _config("gemma3-12b")
    per_token_layer = 2 * 8 * 256 * 2
    assert decode_bytes(cfg, 3, 2048)["kv_bytes"] == 3 * (40 * 1024 + 8 * 2048) * per_token_layer
    assert decode_bytes(cfg, 3, 512)["kv_bytes"] == 3 * 48 * 512 * per_token_layer
    assert decode_bytes(cfg, 1, 512)["weight_bytes"] > 2 * 262208 * 3840   # the tied LM head, read


def test_llama3_70b_in_fp8_reads_about_70_gb_and_an_fp8_kv_cache_half_the_kv():
    """80 layers of 8192: q|k|v 8192 x (8192 + 2 * 1024), o, gate|up 8192 x 2 * 28672, down, each FP8 with a float32
    scale per output; norms, the LM head and one embedding row bf16; the KV at 1 byte per element."""
    def proj(d_in, d_out):
        return d_in * d_out + 4 * d_out
    layer = proj(8192, 10240) + proj(8192, 8192) + proj(8192, 2 * 28672) + proj(28672, 8192) + 2 * 2 * 8192
    cfg = _config("llama3-70b")
    fb = decode_bytes(cfg, 1, 512, kv_elem_bytes=kv_elem_bytes("fp8", 2), fp8=True)
    assert fb["weight_bytes"] == 80 * layer + 2 * (8192 + 128256 * 8192 + 8192)
    assert 70e9 < fb["weight_bytes"] < 71e9
    assert fb["kv_bytes"] == 80 * 2 * 8 * 128 * 512 == decode_bytes(cfg, 1, 512)["kv_bytes"] // 2
    assert (kv_elem_bytes("auto", 2), kv_elem_bytes("fp8_e4m3", 2), kv_elem_bytes("bfloat16", 4)) == (2, 1, 2)


def test_gemma3_without_windows_has_every_layer_global(tmp_path, monkeypatch):
    from engine.models.sliding_window import layer_windows
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with_windows = AutoConfig.from_pretrained(dummy_model("gemma3-12b", tiny=True))
    without = AutoConfig.from_pretrained(dummy_model("gemma3-12b", tiny=True, windows=False))
    assert layer_windows(with_windows) == [16] * 5 + [None]
    assert layer_windows(without) == [None] * 6
