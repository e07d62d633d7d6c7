"""A quantized checkpoint's projections never hold float weights: Linear layers are built on the meta device
(``deferred_weights``), quantized ones get their quantized weight, and a projection the checkpoint leaves
unquantized (its ``ignore`` list) gets memory when its float tensor loads."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear, deferred_weights
from tests.quantization.formats import build_ct_fp8_dynamic


def test_a_deferred_linear_takes_memory_when_a_float_tensor_loads():
    with deferred_weights():
        layer = Linear(8, [4, 4])
    assert layer.weight.is_meta
    assert not Linear(8, [4]).weight.is_meta          # outside the context: as always
    w = torch.randn(4, 8)
    layer.load_slice("weight", 1, w)
    assert not layer.weight.is_meta and torch.equal(layer.weight[4:], w)


def test_unquantized_projections_of_a_quantized_checkpoint_load_as_float(tmp_path):
    """compressed-tensors FP8 with layer 1's MLP left float (``ignore``): those load as float weights, the
    rest as Fp8Weight, and the model equals itself loaded with --quantization none on the same float MLP."""
    path, dequantized = build_ct_fp8_dynamic(tmp_path / "fp8")
    tensors = load_file(path / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        prefix = f"model.layers.1.mlp.{proj}"
        for suffix in ("weight", "weight_scale", "input_scale"):
            tensors.pop(f"{prefix}.{suffix}", None)
        tensors[f"{prefix}.weight"] = dequantized[f"{prefix}.weight"].to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\..*"]
    (path / "config.json").write_text(json.dumps(config))

    llm = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=64)
    model = llm.llm_engine.core.runner.model
    mlp1 = model.get_submodule("model.layers.1.mlp")
    float_layers = [m for m in mlp1.modules() if isinstance(m, Linear)]
    assert float_layers and all(m.weight is not None and not m.weight.is_meta and m.weight_q is None
                                for m in float_layers)
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj").weight_q, Fp8Weight)
    assert not any(p.is_meta for p in model.parameters())
    params = SamplingParams(temperature=0, max_tokens=6)
    ref = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=64, quantization="none")
    assert (llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
            == ref.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids)
