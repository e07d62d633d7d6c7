"""Reading PEFT adapter directories: scales, formats, and every validation error."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora.errors import InvalidLoRAAdapterError, LoRAAdapterNotFoundError
from lora.peft_adapter import (
    LoRATargets,
    load_peft_adapter,
    max_rank_in,
    read_adapter_config,
    read_adapter_tensors,
)
from tests.conftest import build_tiny_checkpoint
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, edit_adapter_config


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoConfig

    from engine.models.llama import LlamaForCausalLM

    root = tmp_path_factory.mktemp("peft-adapters")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    targets = LoRATargets.from_model(LlamaForCausalLM(config, 512))
    good = build_peft_adapter(tiny_llama_dir, root / "good", r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                              seed=0)
    return root, targets, good


def _copy(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    return dst


def _load(path, targets, max_rank=16):
    return load_peft_adapter("x", str(path), targets, max_rank, torch.float32)


def test_targets_map_peft_names_to_packed_slices(setup):
    _, targets, _ = setup
    k = targets.slices["model.layers.1.self_attn.k_proj"]
    assert (k.module_name, k.slice_idx) == ("model.layers.1.self_attn.qkv_proj", 1)
    assert targets.slices["model.layers.0.mlp.up_proj"].slice_idx == 1
    assert targets.slices["model.layers.0.mlp.down_proj"].module_name == "model.layers.0.mlp.down_proj"
    assert len(targets.slices) == 2 * 7
    assert len(targets.module_names) == 2 * 4


def test_load_folds_scale_and_matches_peft_delta(setup, tiny_llama_dir):
    """alpha/r, rsLoRA alpha/sqrt(r), and rank_pattern/alpha_pattern give PEFT's B @ A * scale."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, targets, _ = setup
    cases = {
        "plain": dict(r=4, lora_alpha=12, target_modules=["q_proj", "down_proj"]),
        "rslora": dict(r=16, lora_alpha=8, target_modules=["v_proj", "gate_proj"], use_rslora=True),
        "pattern": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                        rank_pattern={"o_proj": 8}, alpha_pattern={"q_proj": 3.0}),
    }
    for i, (case, kw) in enumerate(cases.items()):
        path = build_peft_adapter(tiny_llama_dir, root / f"scale-{case}", seed=10 + i, **kw)
        adapter = _load(path, targets)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        pm = PeftModel.from_pretrained(base, str(path))
        n = 0
        for peft_name, target in targets.slices.items():
            w = adapter.weights.get((target.module_name, target.slice_idx))
            peft_mod = pm.base_model.model.get_submodule(peft_name)
            if not hasattr(peft_mod, "lora_A"):
                assert w is None
                continue
            n += 1
            want = peft_mod.get_delta_weight("default")                     # [out, in]
            torch.testing.assert_close(w.lora_b @ w.lora_a, want, rtol=1e-5, atol=1e-6)
        assert n == 2 * len(kw["target_modules"]), case
    assert adapter.rank == 8   # the largest per-module rank (rank_pattern)


def test_regex_target_modules_and_bin_format(setup, tiny_llama_dir):
    root, targets, _ = setup
    path = build_peft_adapter(tiny_llama_dir, root / "regex", r=4, lora_alpha=4,
                              target_modules=r".*\.(q|v)_proj", seed=3)
    assert read_adapter_config(path).target_modules == r".*\.(q|v)_proj"
    ours = _load(path, targets)
    assert {k[1] for k in ours.weights} == {0, 2} and len(ours.weights) == 4
    # The same tensors as adapter_model.bin only.
    bin_dir = _copy(path, root / "bin")
    tensors = load_file(str(bin_dir / "adapter_model.safetensors"))
    (bin_dir / "adapter_model.safetensors").unlink()
    torch.save(tensors, bin_dir / "adapter_model.bin")
    from_bin = _load(bin_dir, targets)
    for key, w in ours.weights.items():
        torch.testing.assert_close(from_bin.weights[key].lora_b, w.lora_b)


def test_fan_in_fan_out_accepts_transposed_tensors(setup):
    root, targets, good = setup
    path = _copy(good, root / "fifo")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: v.t().contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    with pytest.raises(InvalidLoRAAdapterError, match="do not fit the base model"):
        _load(path, targets)
    edit_adapter_config(path, fan_in_fan_out=True)
    transposed = _load(path, targets)
    plain = _load(good, targets)
    for key, w in plain.weights.items():
        torch.testing.assert_close(transposed.weights[key].lora_a, w.lora_a)


def test_max_rank_in(setup, tiny_llama_dir):
    root, _, good = setup
    big = build_peft_adapter(tiny_llama_dir, root / "r32", r=32, lora_alpha=32, target_modules=["q_proj"],
                             seed=4)
    assert max_rank_in([str(good)]) == 16
    assert max_rank_in([str(good), str(big)]) == 32
    assert max_rank_in([str(good)], at_least=1) == 8


# ------------------------------------------------------------------------------------------ errors
def test_missing_files_are_not_found(setup, tmp_path):
    _, targets, good = setup
    with pytest.raises(LoRAAdapterNotFoundError, match="does not exist"):
        _load(tmp_path / "nope", targets)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAAdapterNotFoundError, match="adapter_config.json"):
        _load(tmp_path / "empty", targets)
    no_weights = _copy(good, tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterNotFoundError, match="has no weights"):
        _load(no_weights, targets)
    with pytest.raises(LoRAAdapterNotFoundError, match="empty"):
        _load("", targets)


def test_corrupt_files_are_invalid(setup, tmp_path):
    _, targets, good = setup
    bad_json = _copy(good, tmp_path / "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidLoRAAdapterError, match="not valid JSON"):
        _load(bad_json, targets)
    bad_st = _copy(good, tmp_path / "bad-st")
    (bad_st / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(InvalidLoRAAdapterError, match="not a valid weights file"):
        read_adapter_tensors(bad_st)


@pytest.mark.parametrize("changes, message", [
    (dict(r=32), "LoRA rank 32 is greater than max_lora_rank 16"),
    (dict(rank_pattern={"q_proj": 64}), "LoRA rank 64 is greater than max_lora_rank 16"),
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias='all'"),
    (dict(bias="lora_only"), "trained biases"),
    (dict(target_modules=["q_proj", "c_attn"]), r"unknown target modules \['c_attn'\]"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embeddings or the LM head"),
    (dict(target_modules=["lm_head"]), "embeddings or the LM head"),
    (dict(target_modules="(unclosed"), "does not compile"),
    (dict(target_modules=None), "target_modules is missing"),
    (dict(peft_type="IA3"), "only LoRA adapters"),
    (dict(r=0), "r must be a positive integer"),
    (dict(lora_alpha="big"), "lora_alpha must be a number"),
    (dict(trainable_token_indices=[1, 2]), "trainable tokens"),
])
def test_config_errors(setup, tmp_path, changes, message):
    _, targets, good = setup
    path = _copy(good, tmp_path / "a")
    edit_adapter_config(path, **changes)
    if "target_modules" in changes and changes["target_modules"] is None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        assert "target_modules" not in cfg
    with pytest.raises(InvalidLoRAAdapterError, match=message):
        _load(path, targets)


def test_all_problems_in_one_message(setup, tmp_path):
    _, targets, good = setup
    path = _copy(good, tmp_path / "a")
    edit_adapter_config(path, r=64, use_dora=True, bias="all")
    with pytest.raises(InvalidLoRAAdapterError) as err:
        _load(path, targets)
    msg = str(err.value)
    assert "greater than max_lora_rank" in msg and "DoRA" in msg and "bias" in msg
    assert "--max-lora-rank 64" in msg


def _rewrite_tensors(path: Path, fn) -> None:
    f = path / "adapter_model.safetensors"
    tensors = load_file(str(f))
    save_file(fn(tensors), str(f))


def test_tensor_errors(setup, tmp_path):
    _, targets, good = setup
    pre = "base_model.model.model."
    cases = {
        "unknown-module": (lambda t: {**t, pre + "layers.0.mlp.fc1.lora_A.weight": torch.zeros(8, 64),
                                      pre + "layers.0.mlp.fc1.lora_B.weight": torch.zeros(64, 8)},
                           r"expected target modules in .* but received \['model.layers.0.mlp.fc1'\]"),
        "embedding": (lambda t: {**t, pre + "embed_tokens.lora_embedding_A": torch.zeros(8, 384)},
                      "embeddings or the LM head"),
        "lm-head": (lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                               "base_model.model.lm_head.lora_B.weight": torch.zeros(384, 8)},
                    "embeddings or the LM head"),
        "base-weights": (lambda t: {**t, "base_model.model.model.embed_tokens.weight": torch.zeros(384, 64)},
                         "carries base-model weights"),
        "half-pair": (lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_B" not in k},
                      "model.layers.0.self_attn.q_proj has only lora_A"),
        "rank-mismatch": (lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                                     torch.zeros(64, 4)}, "do not fit the base model"),
        "tensor-rank": (lambda t: {k: (torch.zeros(32, v.shape[1]) if "0.self_attn.o_proj.lora_A" in k else
                                       torch.zeros(v.shape[0], 32) if "0.self_attn.o_proj.lora_B" in k
                                       else v) for k, v in t.items()},
                        "model.layers.0.self_attn.o_proj has rank 32, greater than max_lora_rank 16"),
        "no-tensors": (lambda t: {"something_else": torch.zeros(1)}, "carries base-model weights"),
        "empty": (lambda t: {}, "holds no lora_A/lora_B tensors"),
        "dora-tensor": (lambda t: {**t, pre + "layers.0.self_attn.q_proj.lora_magnitude_vector":
                                   torch.zeros(64)}, "DoRA magnitude"),
    }
    for name, (fn, message) in cases.items():
        path = _copy(good, tmp_path / name)
        _rewrite_tensors(path, fn)
        with pytest.raises(InvalidLoRAAdapterError, match=message):
            _load(path, targets)


def test_adapter_for_another_model_does_not_fit(setup, tmp_path):
    """Different hidden size, and more layers than the base model: both rejected, no assert."""
    _, targets, _ = setup
    wide = build_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=32, intermediate_size=64)
    deep = build_tiny_checkpoint(tmp_path / "deep", "llama", num_hidden_layers=3)
    a_wide = build_peft_adapter(wide, tmp_path / "a-wide", r=4, lora_alpha=4, target_modules=ALL_TARGETS,
                                seed=5)
    a_deep = build_peft_adapter(deep, tmp_path / "a-deep", r=4, lora_alpha=4, target_modules=["q_proj"],
                                seed=6)
    with pytest.raises(InvalidLoRAAdapterError, match=r"shapes A \(4, 32\), B \(64, 4\) do not fit"):
        _load(a_wide, targets)
    with pytest.raises(InvalidLoRAAdapterError, match=r"model.layers.2.self_attn.q_proj.*has no such module"):
        _load(a_deep, targets)


def test_scale_value(setup, tiny_llama_dir):
    root, _, _ = setup
    cfg = read_adapter_config(build_peft_adapter(tiny_llama_dir, root / "rs", r=16, lora_alpha=8,
                                                 target_modules=["q_proj"], seed=7, use_rslora=True))
    assert cfg.use_rslora and math.isclose(cfg.scaling("model.layers.0.self_attn.q_proj"), 8 / 4)
