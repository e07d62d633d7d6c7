"""The runner reaches a model only through ``engine.models.interfaces``:

- every registered architecture implements ``ModelForCausalLM`` and the protocol of each capability it
  declares (``ModelCapabilities``), and declares each capability whose methods it implements;
- no module outside ``engine/models/`` reads a model family's attribute names (read from the source with
  ``ast``), and the runner package probes nothing with ``hasattr`` / ``getattr``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Callable

import pytest
import torch

from engine.models.interfaces import DECLARED_PROTOCOLS, ModelCapabilities, ModelForCausalLM, ModelShape
from engine.models.registry import _MODELS

REPO = Path(__file__).resolve().parents[2]

FAMILY_NAMES = frozenset({
    "q_size", "kv_size", "rotary_emb", "self_attn", "embed_tokens", "language_model", "lm_head",
    "decoder_ffn_dim", "decoder_attention_heads", "d_model", "max_source_positions", "max_target_positions",
    "num_key_value_heads", "uses_mrope", "is_encoder_decoder", "supports_tensor_parallel",
})
"""Attribute names of one model family (its modules or its transformers config)."""
FAMILY_KNOWLEDGE_DIRS = ("engine/models/", "engine/loader/")
"""Where those names belong: the models, and the loaders that translate other checkpoint formats
(CTranslate2, GGUF) into a transformers checkpoint."""
NO_PROBING = ("engine/runner/", "engine/cuda_graphs.py", "engine/distributed/rank.py")
"""Modules that hold a model and may call only its declared interface."""


def _tiny_configs() -> dict[str, Callable[[], object]]:
    """Architecture -> a tiny transformers config of it."""
    from transformers import (CLIPVisionConfig, Gemma3Config, Gemma3TextConfig, LlamaConfig, LlavaConfig, MistralConfig,
                              MixtralConfig, Qwen2MoeConfig, Qwen2_5_VLConfig, Qwen2AudioConfig, Qwen2Config, Qwen2VLConfig,
                              Qwen3Config, Qwen3MoeConfig, WhisperConfig)

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    mrope = dict(text, rope_parameters=rope)
    vision = dict(patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_heads=4)
    return {
        "LlamaForCausalLM": lambda: LlamaConfig(**text),
        "MistralForCausalLM": lambda: MistralConfig(**text),
        "Qwen2ForCausalLM": lambda: Qwen2Config(**text),
        "Qwen3ForCausalLM": lambda: Qwen3Config(**text, head_dim=16),
        "Gemma3ForCausalLM": lambda: Gemma3TextConfig(**text, head_dim=16, sliding_window=64,
                                                      final_logit_softcapping=30.0),
        "Gemma3ForConditionalGeneration": lambda: Gemma3Config(
            text_config=Gemma3TextConfig(**text, head_dim=16, sliding_window=64).to_dict(),
            vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=4, image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7),
        "MixtralForCausalLM": lambda: MixtralConfig(**text, num_local_experts=4, num_experts_per_tok=2),
        "Qwen3MoeForCausalLM": lambda: Qwen3MoeConfig(**text, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=16),
        "Qwen2MoeForCausalLM": lambda: Qwen2MoeConfig(**text, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=16, shared_expert_intermediate_size=16),
        "LlavaForConditionalGeneration": lambda: LlavaConfig(
            vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=28, patch_size=14,
                                           projection_dim=32),
            text_config=LlamaConfig(**text), image_token_id=5, vision_feature_layer=-2,
            vision_feature_select_strategy="default", projector_hidden_act="gelu"),
        "Qwen2VLForConditionalGeneration": lambda: Qwen2VLConfig(
            text_config=mrope, vision_config=dict(vision, depth=1, embed_dim=32, hidden_size=32, mlp_ratio=2),
            image_token_id=5),
        "Qwen2_5_VLForConditionalGeneration": lambda: Qwen2_5_VLConfig(
            text_config=mrope, vision_config=dict(vision, depth=1, hidden_size=32, out_hidden_size=32,
                                                  intermediate_size=64, window_size=56,
                                                  fullatt_block_indexes=[0]),
            image_token_id=5),
        "Qwen2AudioForConditionalGeneration": lambda: Qwen2AudioConfig(
            audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64,
                              num_mel_bins=128),
            text_config=dict(text, model_type="qwen2"), audio_token_index=5),
        "WhisperForConditionalGeneration": lambda: WhisperConfig(
            d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64, decoder_layers=1,
            decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=64, num_mel_bins=80,
            max_source_positions=1500, max_target_positions=64),
    }


def _public_methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def _attributes(protocol: type) -> list[str]:
    return [name for name in vars(protocol).get("__annotations__", {}) if not name.startswith("_")]


def _check_protocol(model, protocol: type) -> list[str]:
    """What ``model`` lacks of ``protocol``: attributes, methods, and parameters (by name, in order)."""
    problems = [f"{protocol.__name__}.{name}: missing" for name in _attributes(protocol)
                if not hasattr(model, name)]
    for name, wanted in _public_methods(protocol).items():
        impl = getattr(type(model), name, None)
        if not callable(impl):
            problems.append(f"{protocol.__name__}.{name}: not a method")
            continue
        have = [p for p in inspect.signature(impl).parameters]
        want = [p for p in wanted.parameters]
        if have[:len(want)] != want:
            problems.append(f"{protocol.__name__}.{name}{tuple(want)}: implemented as {tuple(have)}")
    return problems


@pytest.mark.parametrize("arch", sorted(_MODELS))
def test_every_architecture_implements_what_it_declares(arch):
    configs = _tiny_configs()
    assert arch in configs, f"add a tiny config of {arch} to _tiny_configs"
    cls = _MODELS[arch]
    assert isinstance(cls.capabilities, ModelCapabilities), f"{arch} declares no ModelCapabilities"
    model = cls(configs[arch](), max_position=64)
    problems = _check_protocol(model, ModelForCausalLM)
    assert isinstance(model.shape, ModelShape)
    for flag, protocol in DECLARED_PROTOCOLS.items():
        if getattr(cls.capabilities, flag):
            problems += _check_protocol(model, protocol)
        else:   # what it implements, it declares (the runner reads only the declaration)
            problems += [f"{protocol.__name__}.{name}: implemented but capabilities.{flag} is False"
                         for name in _public_methods(protocol) if callable(getattr(cls, name, None))]
    assert not problems, f"{arch}:\n" + "\n".join(problems)


def test_the_protocol_check_finds_a_missing_method():
    class Bare(torch.nn.Module):
        capabilities = ModelCapabilities()

        def forward(self, input_ids, positions):
            return input_ids

    problems = _check_protocol(Bare(), ModelForCausalLM)
    assert "ModelForCausalLM.compute_logits: not a method" in problems
    assert any(p.startswith("ModelForCausalLM.forward") for p in problems)   # inputs_embeds missing
    assert "ModelForCausalLM.shape: missing" in problems


def _sources(prefixes: tuple[str, ...]) -> list[Path]:
    files = sorted((REPO / "engine").rglob("*.py"))
    return [p for p in files if any(str(p.relative_to(REPO)).startswith(x) for x in prefixes)]


def family_names_read(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each ``FAMILY_NAMES`` attribute read: ``x.name`` or ``getattr/hasattr(x, "name")``."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FAMILY_NAMES:
            hits.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in FAMILY_NAMES):
            hits.append((node.lineno, node.args[1].value))
    return hits


def probes(tree: ast.AST) -> list[int]:
    """Lines of ``hasattr`` / ``getattr`` calls."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")]


def test_no_model_family_names_outside_the_models():
    outside = [p for p in sorted((REPO / "engine").rglob("*.py"))
               if not str(p.relative_to(REPO)).startswith(FAMILY_KNOWLEDGE_DIRS)]
    assert any("runner" in str(p) for p in outside)
    hits = [f"{p.relative_to(REPO)}:{line}: {name}" for p in outside
            for line, name in family_names_read(ast.parse(p.read_text()))]
    assert not hits, ("model-family names outside engine/models/ (declare them in "
                      "engine/models/interfaces.py):\n" + "\n".join(hits))


def test_the_runner_probes_no_model():
    files = _sources(NO_PROBING)
    assert len(files) > 3
    hits = [f"{p.relative_to(REPO)}:{line}" for p in files for line in probes(ast.parse(p.read_text()))]
    assert not hits, "hasattr/getattr in the runner (read model.capabilities instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("source, expected", [
    ("n = attn.q_size\n", [(1, "q_size")]),
    ("f = getattr(model, 'uses_mrope', False)\n", [(1, "uses_mrope")]),
    ("h = config.hidden_size\nx = getattr(m, 'foo')\n", []),
])
def test_the_scan_finds_family_names(source, expected):
    assert family_names_read(ast.parse(source)) == expected
