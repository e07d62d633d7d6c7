"""``quantization_config`` -> ``CheckpointQuantization``: every format read, and a one-line error naming the
field, the value and what is supported for the rest."""

from __future__ import annotations

import types

import pytest

from engine.quantization.scheme import FP8, W4A16, CheckpointQuantization, read_checkpoint_quantization


def read(raw: dict) -> CheckpointQuantization:
    return read_checkpoint_quantization(types.SimpleNamespace(quantization_config=raw))


def ct(weights: dict, acts, fmt: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
TOKEN_ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}


def test_formats_read():
    assert read(ct(FP8_WEIGHTS, TOKEN_ACTS, "float-quantized")) == CheckpointQuantization(
        FP8, "compressed-tensors", activation_scheme="dynamic", ignore=("lm_head",))
    static = read(ct(dict(FP8_WEIGHTS, strategy="tensor"), dict(TOKEN_ACTS, strategy="tensor", dynamic=False),
                     "float-quantized"))
    assert static.activation_scheme == "static" and static.weight_block is None
    block = read(ct(dict(FP8_WEIGHTS, strategy="block", block_structure=[128, 128]), TOKEN_ACTS, "float-quantized"))
    assert block.weight_block == (128, 128)
    w4 = read(ct(INT4_WEIGHTS, None, "pack-quantized"))
    assert (w4.kind, w4.group_size, w4.symmetric, w4.act_order) == (W4A16, 128, True, False)
    assert read(ct(dict(INT4_WEIGHTS, actorder="group", symmetric=False), None, "pack-quantized")).act_order
    gptq = read({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "sym": False})
    assert (gptq.group_size, gptq.act_order, gptq.symmetric, gptq.gptq_v2) == (None, True, False, False)
    awq = read({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"})
    assert (awq.format, awq.group_size, awq.symmetric) == ("awq", 128, False)
    hf = read({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    assert (hf.kind, hf.weight_block, hf.activation_scheme) == (FP8, (128, 128), "dynamic")
    assert read_checkpoint_quantization(types.SimpleNamespace()) is None


@pytest.mark.parametrize("raw, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits=3 is not supported; 4-bit"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported; Chorus reads"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "block-wise FP8 weights take dynamic activations"),
    (ct(FP8_WEIGHTS, None, "float-quantized"), "need FP8 activations"),
    (ct(INT4_WEIGHTS, None, "int-quantized"), "format='int-quantized'"),
    (ct(dict(INT4_WEIGHTS, num_bits=8), None, "pack-quantized"), "FP8 (float, 8 bits) and 4-bit integer"),
])
def test_unsupported_schemes_name_the_field(raw, message):
    with pytest.raises(ValueError, match="quantization_config") as e:
        read(raw)
    assert message in str(e.value) and "\n" not in str(e.value)
