"""``--quantization int4`` of the benchmarks (benchmarks/shapes.py): the 4-bit bytes floor of
``decode_bytes`` and the random GPTQ checkpoint of ``int4_checkpoint``, loaded by the engine into its
W4A16 layer on CPU."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.shapes import (add_shape_args, decode_bytes, engine_quantization, int4_checkpoint,
                               resolve_shape_args, shape_fields)


def test_int4_floor_of_llama3_8b():
    """Per layer: qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096 at half a byte a
    weight + a bf16 scale and zero per 128 inputs; the LM head and B embedding rows in bf16; KV as bf16."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("llama", **shape_fields("llama3-8b")[2])
    projections = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    per_layer = sum(i * o // 2 + 2 * (i // 128) * o * 2 for i, o in projections) + 2 * 4096 * 2
    weights = 32 * per_layer + 4096 * 2 + 128256 * 4096 * 2 + 3 * 4096 * 2
    got = decode_bytes(cfg, 3, 100, 2, int4_group_size=128)
    assert got["weight_bytes"] == weights and 4.75e9 < weights < 4.77e9
    assert got["kv_bytes"] == decode_bytes(cfg, 3, 100, 2)["kv_bytes"] == 3 * 100 * 32 * 2 * 8 * 128 * 2
    assert weights < decode_bytes(cfg, 3, 100, 2, fp8=True)["weight_bytes"]


def test_int4_flag_serves_the_gptq_checkpoint(tmp_path, monkeypatch):
    """--quantization int4 --tiny: a GPTQ checkpoint (groups of 32) the engine loads as W4A16 weights and
    generates from; the engine itself takes no --quantization (the checkpoint carries it)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    args = ap.parse_args(["--shape", "llama3-8b", "--tiny", "--quantization", "int4"])
    resolve_shape_args(args)
    assert args.load_format == "auto" and engine_quantization(args) is None
    assert args.model == int4_checkpoint("llama3-8b", tiny=True)               # written once, then reused
    from engine import LLM, SamplingParams
    from engine.layers.linear import Linear
    llm = LLM(args.model, max_model_len=64, seed=0)
    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and {type(m.weight_q).__name__ for m in linears} == {"W4A16Weight"}
    assert {m.weight_q.group_size for m in linears} == {32}
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_int4_checkpoint_refuses_moe():
    with pytest.raises(ValueError, match="dense"):
        int4_checkpoint("qwen3-30b-a3b", tiny=True)
