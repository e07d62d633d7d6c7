"""``--kv-cache-dtype fp8``: the flag's names and refusals, the checkpoint's KV scale names, each layer's
scales (1.0 with one warning where the checkpoint has none), and an FP8 cache holding twice the tokens of a
bfloat16 one in the same bytes."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.attention import AttentionBackend
from engine.config import KV_CACHE_DTYPES, CacheConfig
from engine.kv_scales import (FP8_KV_DTYPE, AttentionScaleName, KVScales, attention_scale_name,
                              kv_scales_from_checkpoint)
from engine.layers.attention import PagedAttention
from engine.runner.kv_cache import KVCache, kv_cache_dtype, layer_kv_scales

CPU = torch.device("cpu")


def layers(n: int = 3) -> list[PagedAttention]:
    return [PagedAttention(num_heads=8, num_kv_heads=2, head_dim=64, scale=0.125) for _ in range(n)]


# ----------------------------------------------------------------------------------------
# The flag
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_names_are_accepted_by_the_config_and_the_parser(name):
    import argparse

    from engine.server.args import add_serve_args

    assert CacheConfig(cache_dtype=name).cache_dtype == name
    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == name


@pytest.mark.parametrize("name", ["fp8_e5m2", "float8", "int8", "FP8"])
def test_unknown_names_are_refused(name):
    assert name not in KV_CACHE_DTYPES
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}': use one of auto, .*fp8, fp8_e4m3"):
        CacheConfig(cache_dtype=name)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_on_cpu_is_refused_as_a_cuda_feature(name):
    with pytest.raises(ValueError, match=f"kv_cache_dtype={name}: an FP8 KV cache is a CUDA feature"):
        kv_cache_dtype(name, torch.bfloat16, CPU, bf16_weights=False)


def test_float_names_keep_their_meaning():
    assert kv_cache_dtype("auto", torch.float32, CPU, bf16_weights=True) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32, CPU, bf16_weights=False) == torch.float16


def test_fp8_cache_needs_the_triton_backend():
    cache = KVCache(layers(), 16, FP8_KV_DTYPE, CPU)
    with pytest.raises(ValueError, match="FP8 KV cache needs the triton attention backend"):
        cache.allocate(4, AttentionBackend("torch"))


# ----------------------------------------------------------------------------------------
# Checkpoint scale names
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layer,kind", [
    ("model.layers.3.self_attn.k_scale", 3, "k"),
    ("model.layers.3.self_attn.v_scale", 3, "v"),
    ("model.layers.12.self_attn.kv_scale", 12, "kv"),
    ("model.layers.0.self_attn.attn.k_scale", 0, "k"),
    ("model.layers.5.self_attn.k_proj.output_scale", 5, "k"),
    ("model.layers.5.self_attn.v_proj.output_scale", 5, "v"),
    ("model.layers.5.self_attn.k_proj.k_scale", 5, "k"),
    ("model.layers.5.self_attn.v_proj.v_scale", 5, "v"),
    ("model.layers.1.self_attn.q_scale", 1, "q"),
    ("model.layers.1.self_attn.prob_scale", 1, "prob"),
    ("model.layers.1.self_attn.q_proj.output_scale", 1, "q"),
    ("language_model.model.layers.2.self_attn.k_scale", 2, "k"),
    ("model.language_model.layers.2.self_attn.v_scale", 2, "v"),
    ("model.decoder.layers.4.self_attn.k_scale", 4, "k"),
])
def test_scale_names(name, layer, kind):
    assert attention_scale_name(name) == AttentionScaleName(layer, kind)


@pytest.mark.parametrize("name", [
    "model.layers.3.self_attn.k_proj.weight_scale",        # FP8 weights, not the cache
    "model.layers.3.self_attn.k_proj.input_scale",
    "model.layers.3.self_attn.k_proj.v_scale",
    "model.layers.3.mlp.down_proj.output_scale",
    "model.encoder.layers.3.self_attn.k_scale",            # no KV cache
    "vision_tower.vision_model.encoder.layers.3.self_attn.k_proj.output_scale",
    "model.layers.3.self_attn.k_scale.extra",
])
def test_other_names_are_not_scales(name):
    assert attention_scale_name(name) is None


def test_scales_from_checkpoint_forms():
    t = torch.tensor
    tensors = [
        ("model.embed_tokens.weight", torch.zeros(4, 4)),
        ("model.layers.0.self_attn.k_scale", t(0.5)),
        ("model.layers.0.self_attn.v_scale", t([0.25])),
        ("model.layers.1.self_attn.kv_scale", t(2.0, dtype=torch.bfloat16)),
        ("model.layers.2.self_attn.k_proj.output_scale", t([0.125])),
        ("model.layers.2.self_attn.v_proj.output_scale", t(3.0)),
        ("model.layers.3.self_attn.k_scale", t(0.75)),               # no v: both take k's
        ("model.layers.3.self_attn.q_scale", t(9.0)),                # not used
    ]
    assert kv_scales_from_checkpoint(tensors) == {
        0: KVScales(0.5, 0.25), 1: KVScales(2.0, 2.0), 2: KVScales(0.125, 3.0), 3: KVScales(0.75, 0.75)}


@pytest.mark.parametrize("tensors,match", [
    ([("model.layers.0.self_attn.k_scale", torch.ones(8))], "only per-tensor scales"),
    ([("model.layers.0.self_attn.v_scale", torch.tensor(-1.0))], "must be positive and finite"),
    ([("model.layers.0.self_attn.v_scale", torch.tensor(float("nan")))], "must be positive and finite"),
    ([("model.layers.0.self_attn.kv_scale", torch.tensor(1.0)),
      ("model.layers.0.self_attn.k_scale", torch.tensor(2.0))], "already has a k_scale"),
])
def test_bad_checkpoint_scales_are_refused(tensors, match):
    with pytest.raises(ValueError, match=match):
        kv_scales_from_checkpoint(tensors)


# ----------------------------------------------------------------------------------------
# Each layer's scales
# ----------------------------------------------------------------------------------------
def test_fp8_layers_take_the_checkpoint_scales_else_one_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="chorus.runner"):
        got = layer_kv_scales({0: KVScales(0.5, 2.0), 2: KVScales(0.1, 0.2)}, 4, FP8_KV_DTYPE)
    assert got == [KVScales(0.5, 2.0), KVScales(1.0, 1.0), KVScales(0.1, 0.2), KVScales(1.0, 1.0)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 4 layers" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chorus.runner"):
        assert layer_kv_scales({}, 3, FP8_KV_DTYPE) == [KVScales(1.0, 1.0)] * 3
    assert len(caplog.records) == 1 and "any layer" in caplog.records[0].getMessage()


def test_float_caches_ignore_checkpoint_scales(caplog):
    with caplog.at_level(logging.INFO, logger="chorus.runner"):
        assert layer_kv_scales({0: KVScales(0.5, 2.0)}, 2, torch.bfloat16) == [KVScales(1.0, 1.0)] * 2
    assert "unused" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_scales_for_missing_layers_are_refused():
    with pytest.raises(ValueError, match=r"KV cache scales for layers \[5\]"):
        layer_kv_scales({5: KVScales(0.5, 2.0)}, 4, FP8_KV_DTYPE)


def test_allocate_binds_each_layers_scales():
    ls = layers(2)
    KVCache(ls, 16, FP8_KV_DTYPE, CPU, {1: KVScales(0.5, 4.0)}).allocate(3, AttentionBackend("triton"))
    assert [(a.k_scale, a.v_scale) for a in ls] == [(1.0, 1.0), (0.5, 4.0)]
    assert all(a.k_cache.dtype == FP8_KV_DTYPE and a.k_cache.shape == (3, 16, 2, 64) for a in ls)
    ls = layers(2)
    KVCache(ls, 16, torch.bfloat16, CPU, {1: KVScales(0.5, 4.0)}).allocate(3, AttentionBackend("torch"))
    assert [(a.k_scale, a.v_scale) for a in ls] == [(1.0, 1.0), (1.0, 1.0)]


# ----------------------------------------------------------------------------------------
# Capacity
# ----------------------------------------------------------------------------------------
def test_fp8_holds_twice_the_tokens_of_bfloat16(caplog):
    """The same budget (CPU: ``kv_cache_space`` GiB) fits twice the blocks, and the start-up log says so."""
    bf16, fp8 = KVCache(layers(), 16, torch.bfloat16, CPU), KVCache(layers(), 16, FP8_KV_DTYPE, CPU)
    # layers x (K, V) x KV heads x head_dim x block_size x 2 bytes
    assert bf16.bytes_per_block() == 2 * fp8.bytes_per_block() == 3 * 2 * 2 * 64 * 16 * 2
    cc = CacheConfig(kv_cache_space=100 * bf16.bytes_per_block() / (1 << 30))               # 100 bf16 blocks
    num_bf16 = bf16.blocks_that_fit(cc, 10 ** 9, 0)
    num_fp8 = fp8.blocks_that_fit(cc, 10 ** 9, 0)
    assert (num_bf16, num_fp8) == (100, 200)
    with caplog.at_level(logging.INFO, logger="chorus.runner"):
        fp8.allocate(num_fp8, AttentionBackend("triton"))
    assert f"KV cache: {num_fp8} blocks x 16 tokens = {num_fp8 * 16} tokens, float8_e4m3fn" in caplog.text


def test_a_checkpoint_with_kv_scales_loads_and_carries_them(tiny_llama_dir, tmp_path):
    """Scale tensors (``k_scale`` / ``v_scale``, compressed-tensors' ``k_proj.output_scale``) reach the model
    load as scales, not as weights without a place; a float cache leaves every layer at 1.0."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine import LLM, SamplingParams
    from engine.kv_scales import KVScales

    out = tmp_path / "with-kv-scales"
    shutil.copytree(tiny_llama_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    weights["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([2.0])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=str(out), device="cpu", max_model_len=64)
    runner = llm.llm_engine.core.runner
    assert runner.kv_cache.scales[0] == KVScales(1.0, 1.0)   # float cache: scales unused
    plain = LLM(model=str(tiny_llama_dir), device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=5)
    assert (llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
            == plain.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids)
