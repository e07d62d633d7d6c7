"""encoders/: the CLIP, SigLIP and Qwen2-VL vision towers against transformers' own models.

Parity runs in float32 on CPU on tiny random configs (weights redrawn at a larger scale than
transformers' init so every op matters), bound 1e-4 max abs diff. The full-size tests build
transformers' model and ours on the meta device and load one into the other, so real checkpoints'
names and shapes are covered without allocating them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel
from transformers.activations import ACT2FN
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from encoders.clip import CLIPVisionTower
from encoders.qwen2_5_vl import Qwen2_5_VLVisionTransformer, window_layout
from encoders.qwen2_vl import SegmentRun, GridError, Qwen2VLVisionTransformer, frame_runs
from encoders.siglip import SiglipVisionTower
from encoders.vit import ACTIVATIONS, FeatureLayerError, WeightLoadError

MAX_ABS_DIFF = 1e-4

TINY_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                image_size=42, patch_size=14)
TOWERS = {
    "clip": (CLIPVisionConfig, CLIPVisionModel, CLIPVisionTower),
    "siglip": (SiglipVisionConfig, SiglipVisionModel, SiglipVisionTower),
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights at scale 0.2 (norm scales around 1), so a wrong op shows far above the bound."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.2
            is_norm = "norm" in name or "ln_q" in name
            is_norm_scale = param.dim() == 1 and name.endswith("weight") and is_norm
            param.copy_(1.0 + noise if is_norm_scale else noise)


def _hf_vit(kind: str, seed: int = 0, **overrides):
    config_cls, model_cls, _ = TOWERS[kind]
    config = config_cls(**{**TINY_VIT, **overrides})
    model = model_cls(config).eval()
    _redraw(model, seed)
    return config, model


def _loaded_vit(kind: str, num_layers=None, **overrides):
    """(config, transformers' model, our tower with its weights loaded)."""
    config, hf = _hf_vit(kind, **overrides)
    tower = TOWERS[kind][2](config, num_layers)
    tower.load_weights(hf.state_dict().items())
    return config, hf, tower


def _pixels(config, num_images: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(num_images, 3, config.image_size, config.image_size, generator=gen)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------------ CLIP / SigLIP

@pytest.mark.parametrize("kind", sorted(TOWERS))
@pytest.mark.parametrize("feature_layers", [[0], [1], [-1], [-2], [0, 2, -1, 1]])
def test_vit_tower_matches_transformers_hidden_states(kind, feature_layers):
    config, hf, tower = _loaded_vit(kind)
    pixels = _pixels(config)
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states
        features = tower(pixels, feature_layers)
    assert len(features) == len(feature_layers)
    for layer, got in zip(feature_layers, features):
        assert _max_diff(got, expected[layer]) <= MAX_ABS_DIFF, (kind, layer)


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vit_tower_truncated_stack_skips_unbuilt_tensors(kind):
    config, hf, tower = _loaded_vit(kind, num_layers=2)  # layer 2 (and the heads) in the checkpoint, skipped
    assert len(tower.encoder.layers) == 2
    pixels = _pixels(config)
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states
        (features,) = tower(pixels, [-2])
    assert _max_diff(features, expected[2]) <= MAX_ABS_DIFF
    with pytest.raises(FeatureLayerError, match="num_layers=2; build it with num_layers >= 3"):
        tower(pixels, [-1])


def test_clip_llava_layout_builds_no_last_layer_or_post_layernorm():
    tower = CLIPVisionTower(CLIPVisionConfig(**TINY_VIT), num_layers=TINY_VIT["num_hidden_layers"] - 1)
    names = {name for name, _ in tower.named_parameters()}
    assert not any(name.startswith(("post_layernorm", "encoder.layers.2.")) for name in names)
    assert "encoder.layers.1.self_attn.qkv.weight" in names


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vit_tower_stops_after_the_deepest_requested_layer(kind):
    config, hf, tower = _loaded_vit(kind)
    ran = []
    for index, layer in enumerate(tower.encoder.layers):
        layer.register_forward_hook(lambda module, args, out, index=index: ran.append(index))
    with torch.no_grad():
        tower(_pixels(config), [1, 0])
    assert ran == [0]


def test_siglip_post_layernorm_is_built_with_every_layer_and_optional_in_the_checkpoint():
    config, hf, full = _loaded_vit("siglip")
    pixels = _pixels(config)
    with torch.no_grad():
        (last,) = full(pixels, [-1])
        assert _max_diff(full.post_layernorm(last), hf(pixels).last_hidden_state) <= MAX_ABS_DIFF
    assert SiglipVisionTower(config, num_layers=2).post_layernorm is None
    without = SiglipVisionTower(config)
    without.load_weights((name, t) for name, t in hf.state_dict().items()
                         if not name.startswith("post_layernorm."))
    assert without.post_layernorm is None
    half = {name: t for name, t in hf.state_dict().items() if name != "post_layernorm.bias"}
    with pytest.raises(WeightLoadError, match="left 1 parameter.*'post_layernorm.bias'"):
        SiglipVisionTower(config).load_weights(half.items())


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vit_tower_accepts_transformers4_vision_model_prefix(kind):
    config, hf = _hf_vit(kind)
    tower = TOWERS[kind][2](config)
    tower.load_weights((f"vision_model.{name}", tensor) for name, tensor in hf.state_dict().items())
    pixels = _pixels(config)
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states[-1]
        assert _max_diff(tower(pixels, [-1])[0], expected) <= MAX_ABS_DIFF


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vit_tower_casts_pixels_to_its_dtype(kind):
    config, hf, tower = _loaded_vit(kind)
    pixels = _pixels(config)
    with torch.no_grad():
        from_double = tower(pixels.double(), [1])[0]
        assert from_double.dtype == torch.float32
        assert _max_diff(from_double, tower(pixels, [1])[0]) <= MAX_ABS_DIFF
        assert tower.to(torch.bfloat16)(pixels, [1])[0].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new", "silu"])
def test_activation_table_is_transformers_act2fn(name):
    x = torch.linspace(-6, 6, 1001)
    assert torch.equal(ACTIVATIONS[name](x), ACT2FN[name](x))


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_clip_tower_with_other_activations(hidden_act):
    config, hf, tower = _loaded_vit("clip", hidden_act=hidden_act)
    pixels = _pixels(config)
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states[-1]
        assert _max_diff(tower(pixels, [-1])[0], expected) <= MAX_ABS_DIFF


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vit_tower_rejects_bad_feature_layers_sizes_and_depths(kind):
    config = TOWERS[kind][0](**TINY_VIT)
    tower = TOWERS[kind][2](config)
    pixels = _pixels(config)
    with pytest.raises(FeatureLayerError, match=r"feature layer 4 is outside .* \(valid: -4..3\)"):
        tower(pixels, [4])
    with pytest.raises(FeatureLayerError, match="non-empty"):
        tower(pixels, [])
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, 42, 42\]"):
        tower(torch.zeros(1, 3, 28, 28), [0])
    with pytest.raises(ValueError, match="num_layers=4 must be between 0 and"):
        TOWERS[kind][2](config, num_layers=4)


def _load_errors(tower: torch.nn.Module, state: dict[str, torch.Tensor], bad_name: str, dropped_name: str,
                 unset_param: str, wrong_shape_name: str) -> None:
    """Unknown name, a missing tensor (``dropped_name`` leaves ``unset_param`` unset), a misshapen tensor:
    each a WeightLoadError naming it."""
    with pytest.raises(WeightLoadError, match=f"'{bad_name}' has no place in the tower"):
        tower.load_weights([*state.items(), (bad_name, torch.zeros(1))])
    missing = {name: tensor for name, tensor in state.items() if name != dropped_name}
    with pytest.raises(WeightLoadError, match=f"left 1 parameter.*'{unset_param}'"):
        tower.load_weights(missing.items())
    misshapen = {**state, wrong_shape_name: torch.zeros(3, 3)}
    with pytest.raises(WeightLoadError, match=f"'{wrong_shape_name}' has shape \\[3, 3\\]"):
        tower.load_weights(misshapen.items())


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vit_tower_load_errors(kind):
    config, hf = _hf_vit(kind)
    _load_errors(TOWERS[kind][2](config), dict(hf.state_dict()), bad_name="vision_tower.embeddings.bogus",
                 dropped_name="encoder.layers.1.self_attn.k_proj.bias",
                 unset_param="encoder.layers.1.self_attn.qkv.bias",
                 wrong_shape_name="encoder.layers.0.mlp.fc1.weight")


# ------------------------------------------------------------------------------------ Qwen2-VL, Qwen2.5-VL

TINY_QWEN2_VL = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=4, hidden_size=48, patch_size=14,
                     temporal_patch_size=2, spatial_merge_size=2)


def _hf_qwen2_vl(seed: int = 0):
    config = Qwen2VLVisionConfig(**TINY_QWEN2_VL)
    model = Qwen2VisionTransformerPretrainedModel(config).eval()
    _redraw(model, seed)
    return config, model


# window_size 56 = 2 x 2 merge blocks = 16 patches a window; blocks 1 and 3 attend to the whole frame.
TINY_QWEN2_5_VL = dict(depth=4, hidden_size=32, num_heads=4, intermediate_size=48, out_hidden_size=40,
                       patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                       fullatt_block_indexes=[1, 3])


def _hf_qwen2_5_vl(seed: int = 0):
    config = Qwen2_5_VLVisionConfig(**TINY_QWEN2_5_VL)
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    _redraw(model, seed)
    return config, model


def _patches(grid_thw: torch.Tensor) -> torch.Tensor:
    num_patches = int(grid_thw.prod(-1).sum())
    return torch.randn(num_patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))


QWEN_GRIDS = [
    [[1, 4, 6], [1, 8, 4]],  # two images of different grids: two segments; full and partial windows
    [[1, 4, 4], [1, 4, 4], [2, 4, 6], [1, 2, 2]],  # equal images batched, a 2-frame video, a small image
    [[1, 10, 14], [2, 6, 4], [1, 2, 2], [1, 8, 8], [1, 8, 8]],  # every window shape
]


def _loaded_qwen(kind: str):
    """(transformers' model, our tower with its weights loaded) for "qwen2_vl" or "qwen2_5_vl"."""
    config, hf = _hf_qwen2_vl() if kind == "qwen2_vl" else _hf_qwen2_5_vl()
    tower = Qwen2VLVisionTransformer(config) if kind == "qwen2_vl" else Qwen2_5_VLVisionTransformer(config)
    tower.load_weights(hf.state_dict().items())
    return hf, tower


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("grids", QWEN_GRIDS)
def test_qwen_vision_matches_transformers(kind, grids):
    hf, tower = _loaded_qwen(kind)
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    pixels = _patches(grid_thw)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid_thw).pooler_output
        got = tower(pixels, grid_thw)
    assert expected.shape[0] == pixels.shape[0] // 4
    assert _max_diff(got, expected) <= MAX_ABS_DIFF


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vision_images_attend_only_to_themselves(kind):
    _, tower = _loaded_qwen(kind)
    grid_thw = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixels = _patches(grid_thw)
    with torch.no_grad():
        together = tower(pixels, grid_thw)
        second_alone = tower(pixels[24:], grid_thw[1:])
    assert _max_diff(together[6:], second_alone) <= MAX_ABS_DIFF


def test_frame_runs_batch_consecutive_equal_frames():
    assert frame_runs([[1, 4, 6], [1, 4, 6], [2, 4, 4], [1, 4, 4], [1, 2, 2]]) == [
        SegmentRun(first_patch=0, num_segments=2, patches_per_segment=24),
        SegmentRun(first_patch=48, num_segments=3, patches_per_segment=16),
        SegmentRun(first_patch=96, num_segments=1, patches_per_segment=4),
    ]


def test_qwen2_vl_rejects_inconsistent_grids():
    config, _ = _hf_qwen2_vl()
    tower = Qwen2VLVisionTransformer(config)
    grid_thw = torch.tensor([[1, 4, 6]])
    with pytest.raises(GridError, match=r"pixel_values must be \[24, 1176\]"):
        tower(torch.zeros(20, 1176), grid_thw)
    with pytest.raises(GridError, match="multiples of spatial_merge_size=2"):
        tower(torch.zeros(15, 1176), torch.tensor([[1, 3, 5]]))


def test_qwen2_vl_load_errors():
    config, hf = _hf_qwen2_vl()
    state = dict(hf.state_dict())
    _load_errors(Qwen2VLVisionTransformer(config), state, bad_name="visual.blocks.0.attn.qkv.weight",
                 dropped_name="blocks.1.attn.qkv.bias", unset_param="blocks.1.attn.qkv.bias",
                 wrong_shape_name="blocks.1.norm2.bias")
    with pytest.raises(WeightLoadError, match=r"'patch_embed.proj.weight' has shape \[32, 3, 1, 14, 14\]"):
        Qwen2VLVisionTransformer(config).load_weights(
            [*state.items(), ("patch_embed.proj.weight", torch.zeros(32, 3, 1, 14, 14))])


def test_window_layout_groups_windows_by_size_within_each_frame():
    # One 3 x 3-block frame with 2 x 2-block windows: sizes 4, 2, 2, 1 blocks (x4 patches each).
    layout = window_layout([[1, 6, 6]], merge_size=2, window_blocks=2)
    assert layout.unit_order.tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8]
    assert layout.runs == [SegmentRun(0, 1, 16), SegmentRun(16, 2, 8), SegmentRun(32, 1, 4)]
    two_frames = window_layout([[2, 6, 6]], merge_size=2, window_blocks=2)
    assert two_frames.unit_order.tolist()[9:] == [9, 10, 12, 13, 11, 14, 15, 16, 17]
    assert [run.patches_per_segment for run in two_frames.runs] == [16, 8, 4, 16, 8, 4]


def test_qwen2_5_vl_load_errors():
    config, hf = _hf_qwen2_5_vl()
    _load_errors(Qwen2_5_VLVisionTransformer(config), dict(hf.state_dict()),
                 bad_name="blocks.0.mlp.fc1.weight",
                 dropped_name="blocks.2.mlp.up_proj.bias", unset_param="blocks.2.mlp.gate_up_proj.bias",
                 wrong_shape_name="merger.ln_q.weight")


# ------------------------------------------------------------------------------------ full shapes, on meta

def _numel(named: dict[str, torch.Tensor], skip=lambda name: False) -> int:
    return sum(t.numel() for name, t in named.items() if not skip(name))


def test_clip_vit_l14_336_llava_layout_on_meta():
    config = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu",
                              projection_dim=768)
    with torch.device("meta"):
        hf = CLIPVisionModel(config)
        tower = CLIPVisionTower(config, num_layers=23)
    state = dict(hf.state_dict())
    tower.load_weights(state.items())
    skipped = lambda name: name.startswith(("post_layernorm.", "encoder.layers.23."))  # noqa: E731
    assert _numel(dict(tower.named_parameters())) == _numel(state, skipped)
    (features,) = tower(torch.empty(2, 3, 336, 336, device="meta"), [1])  # meta ops are slow: one layer
    assert features.shape == (2, 577, 1024)


def test_siglip_so400m_patch14_384_layout_on_meta():
    config = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                num_attention_heads=16, image_size=384, patch_size=14)
    with torch.device("meta"):
        hf = SiglipVisionModel(config)
        tower = SiglipVisionTower(config)
    state = dict(hf.state_dict())
    tower.load_weights(state.items())
    assert _numel(dict(tower.named_parameters())) == _numel(state, lambda name: name.startswith("head."))
    (features,) = tower(torch.empty(1, 3, 384, 384, device="meta"), [1])  # meta ops are slow: one layer
    assert features.shape == (1, 729, 1152)


def test_qwen2_vl_7b_vision_layout_on_meta():
    config = Qwen2VLVisionConfig(embed_dim=1280, depth=32, num_heads=16, mlp_ratio=4, hidden_size=3584,
                                 patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    with torch.device("meta"):
        hf = Qwen2VisionTransformerPretrainedModel(config)
        tower = Qwen2VLVisionTransformer(config)
    state = dict(hf.state_dict())
    tower.load_weights(state.items())
    assert _numel(dict(tower.named_parameters())) == _numel(state)
    tower.blocks = tower.blocks[:2]  # meta ops are slow; the depth does not change a shape
    grid_thw = torch.tensor([[1, 16, 16], [1, 32, 24]])
    out = tower(torch.empty(256 + 768, 1176, device="meta"), grid_thw)
    assert out.shape == (256, 3584)


def test_qwen2_5_vl_7b_vision_layout_on_meta():
    config = Qwen2_5_VLVisionConfig(hidden_size=1280, depth=32, num_heads=16, intermediate_size=3420,
                                    out_hidden_size=3584, patch_size=14, temporal_patch_size=2,
                                    spatial_merge_size=2, window_size=112,
                                    fullatt_block_indexes=[7, 15, 23, 31])
    with torch.device("meta"):
        hf = Qwen2_5_VisionTransformerPretrainedModel(config)
        tower = Qwen2_5_VLVisionTransformer(config)
    state = dict(hf.state_dict())
    tower.load_weights(state.items())
    assert _numel(dict(tower.named_parameters())) == _numel(state)
    tower.blocks = tower.blocks[:8]  # meta ops are slow; blocks 0-7 have window and full attention
    grid_thw = torch.tensor([[1, 16, 16], [1, 36, 20]])
    out = tower(torch.empty(256 + 720, 1176, device="meta"), grid_thw)
    assert out.shape == (244, 3584)
