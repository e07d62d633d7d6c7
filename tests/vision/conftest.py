"""Tiny random vision-language checkpoints (LLaVA with CLIP or SigLIP, Qwen2-VL), saved by
transformers with a real BPE tokenizer and image processor, plus test images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import build_tokenizer

QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
QWEN_CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}"
             "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
             "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif c['type'] == 'text' %}{{ c['text'] }}"
             "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _text_config(tok, **overrides) -> dict:
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=1024,
               eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    cfg.update(overrides)
    return cfg


def build_tiny_llava(out_dir: Path, tower: str = "clip", seed: int = 0, strategy: str = "default",
                     feature_layer=-2, legacy_layout: bool = False, text: str = "llama") -> Path:
    """A tiny ``LlavaForConditionalGeneration`` (transformers' own) saved with its tokenizer and image
    processor; ``legacy_layout`` renames the tensors to the transformers 4.x layout."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, Qwen2Config, SiglipImageProcessor,
                              SiglipVisionConfig)

    tok = build_tokenizer()
    vision_kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         image_size=56, patch_size=14)
    if tower == "clip":
        vision = CLIPVisionConfig(projection_dim=32, **vision_kwargs)
        proc = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    else:
        vision = SiglipVisionConfig(**vision_kwargs)
        proc = SiglipImageProcessor(size={"height": 56, "width": 56})
    text_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[text]
    cfg = LlavaConfig(vision_config=vision, text_config=text_cls(**_text_config(tok)),
                      image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=feature_layer,
                      vision_feature_select_strategy=strategy, projector_hidden_act="gelu")
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # transformers initializes small: make the image matter
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    proc.save_pretrained(out_dir)
    if legacy_layout:
        _rename_tensors(out_dir, [("model.language_model.", "language_model.model."),
                                  ("lm_head.", "language_model.lm_head."),
                                  ("model.vision_tower.", "vision_tower."),
                                  ("model.multi_modal_projector.", "multi_modal_projector.")])
    return out_dir


def build_tiny_qwen2_vl(out_dir: Path, seed: int = 0, legacy_layout: bool = False, version: str = "2") -> Path:
    """A tiny ``Qwen2VLForConditionalGeneration`` (``version="2.5"``: Qwen2.5-VL) saved with its
    tokenizer and image processor."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor)

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"] + QWEN_SPECIALS})
    tok.chat_template = QWEN_CHAT
    head_dim = 16
    text = _text_config(tok, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]})
    assert head_dim == text["hidden_size"] // text["num_attention_heads"]
    vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=4, mlp_ratio=2,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    if version == "2.5":
        vision = dict(depth=3, hidden_size=32, out_hidden_size=text["hidden_size"], num_heads=4,
                      intermediate_size=64, window_size=56, fullatt_block_indexes=[1], patch_size=14,
                      temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    cfg = config_cls(text_config=text, vision_config=vision,
                        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.model.visual.merger.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    # Small images: 56x56 .. 28*28*64 pixels -> 4 .. 64 tokens.
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(out_dir)
    if legacy_layout:
        _rename_tensors(out_dir, [("model.language_model.", "model."), ("model.visual.", "visual.")])
    return out_dir


def _rename_tensors(out_dir: Path, renames: list[tuple[str, str]]) -> None:
    from safetensors.torch import load_file, save_file

    for path in out_dir.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {}
        for name, t in tensors.items():
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            renamed[name] = t
        save_file(renamed, path, metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()


def make_image(width_px: int, height_px: int, seed: int) -> Image.Image:
    """A smooth random RGB image (structured, so resizing keeps it distinct from others)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height_px // 8), max(2, width_px // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width_px, height_px), Image.BILINEAR)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="session")
def images() -> list[Image.Image]:
    return [make_image(64, 48, 0), make_image(40, 72, 1), make_image(90, 90, 2), make_image(33, 57, 3)]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
