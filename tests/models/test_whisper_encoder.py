"""encoders/whisper.py: Whisper's audio encoder against transformers' ``WhisperModel(config).encoder``.

Parity runs in float32 on CPU on tiny random configs with the real input length (3000 mel frames ->
1500 positions), every weight (positions included) redrawn at a larger scale than transformers' init so
a wrong op shows; bound 1e-4 max abs diff. The full-size tests build transformers' encoder and ours on the
meta device for tiny.en, base and large-v3-turbo and load one into the other.
"""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig, WhisperModel

from encoders.vit import WeightLoadError
from encoders.whisper import LORA_TARGET_MODULES, WhisperEncoderTower
from tests.models.test_vision_encoders import MAX_ABS_DIFF, _load_errors, _max_diff, _redraw

# The decoder is built by WhisperModel but never run: keep it one small layer, its special ids in vocab.
TINY_DECODER = dict(decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=100,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _config(num_mel_bins: int = 80, encoder_layers: int = 2, **overrides) -> WhisperConfig:
    return WhisperConfig(**{**TINY_DECODER, "d_model": 64, "encoder_layers": encoder_layers,
                            "encoder_attention_heads": 4, "encoder_ffn_dim": 256,
                            "num_mel_bins": num_mel_bins, "max_source_positions": 1500, **overrides})


def _hf_encoder(config: WhisperConfig, seed: int = 0) -> torch.nn.Module:
    encoder = WhisperModel(config).encoder.eval()
    _redraw(encoder, seed)
    return encoder


def _loaded(num_mel_bins: int = 80, encoder_layers: int = 2):
    """(config, transformers' encoder, our tower with its weights loaded)."""
    config = _config(num_mel_bins, encoder_layers)
    hf = _hf_encoder(config)
    tower = WhisperEncoderTower(config)
    tower.load_weights(hf.state_dict().items())
    return config, hf, tower


def _mel(config: WhisperConfig, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, config.num_mel_bins, 3000, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("num_mel_bins, encoder_layers", [(80, 2), (128, 4)])
def test_whisper_encoder_matches_transformers(num_mel_bins, encoder_layers):
    config, hf, tower = _loaded(num_mel_bins, encoder_layers)
    mel = _mel(config)
    with torch.no_grad():
        expected = hf(mel).last_hidden_state
        got = tower(mel)
    assert got.shape == (3, 1500, 64) and got.dtype == torch.float32
    assert expected.abs().max() > 1.0  # the outputs are not near zero, so the bound means something
    assert _max_diff(got, expected) <= MAX_ABS_DIFF


def test_whisper_encoder_casts_features_to_its_dtype():
    config, _, tower = _loaded()
    mel = _mel(config, batch=1)
    with torch.no_grad():
        reference = tower(mel)
        assert torch.equal(tower(mel.double()), reference)
        half = tower.to(torch.bfloat16)(mel)
    assert half.dtype == torch.bfloat16
    assert (half.float() - reference).abs().mean() < 0.02


def test_whisper_encoder_rejects_bad_shapes():
    config, _, tower = _loaded()
    with pytest.raises(ValueError, match=r"input_features must be \[B, 80, 3000\].*got \[1, 80, 2998\]"):
        tower(torch.zeros(1, 80, 2998))
    with pytest.raises(ValueError, match=r"got \[1, 128, 3000\]"):
        tower(torch.zeros(1, 128, 3000))
    with pytest.raises(ValueError, match=r"got \[80, 3000\]"):
        tower(torch.zeros(80, 3000))
    with pytest.raises(ValueError, match="d_model=64 is not a multiple of encoder_attention_heads=6"):
        WhisperEncoderTower(_config(encoder_attention_heads=6))


def test_whisper_encoder_load_errors():
    config = _config()
    state = dict(_hf_encoder(config).state_dict())
    _load_errors(WhisperEncoderTower(config), state, bad_name="model.encoder.conv1.weight",
                 dropped_name="layers.1.self_attn.v_proj.bias", unset_param="layers.1.self_attn.qkv.bias",
                 wrong_shape_name="layers.0.fc1.weight")
    _load_errors(WhisperEncoderTower(config), state, bad_name="layers.0.self_attn.k_proj.bias",
                 dropped_name="layers.0.self_attn.k_proj.weight",
                 unset_param="layers.0.self_attn.qkv.weight", wrong_shape_name="embed_positions.weight")
    with pytest.raises(WeightLoadError, match="strip any outer prefix such as 'model.encoder.' first"):
        WhisperEncoderTower(config).load_weights([("model.encoder.conv1.weight", torch.zeros(1))])
    unset = {name: tensor for name, tensor in state.items() if not name.startswith("layer_norm.")}
    with pytest.raises(WeightLoadError, match="left 2 parameter.*'layer_norm.weight', 'layer_norm.bias'"):
        WhisperEncoderTower(config).load_weights(unset.items())


def test_whisper_lora_targets_are_transformers_projections():
    """Every q/k/v/out_proj/fc1/fc2 of transformers' encoder maps to a row block of one of our Linears
    holding exactly its weight and bias (zero bias for k_proj, which has none)."""
    _, hf, tower = _loaded()
    targets = tower.lora_targets()
    hf_linears = {name: module for name, module in hf.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(targets) == set(hf_linears)
    assert {name.rsplit(".", 1)[1] for name in targets} == set(LORA_TARGET_MODULES)
    for name, target in targets.items():
        ours, theirs = tower.get_submodule(target.module), hf_linears[name]
        rows = ours.output_size // target.num_shards
        block = slice(target.shard * rows, (target.shard + 1) * rows)
        assert ours.input_size == theirs.in_features and rows == theirs.out_features, name
        assert torch.equal(ours.weight[block], theirs.weight), name
        expected_bias = torch.zeros(rows) if theirs.bias is None else theirs.bias
        assert torch.equal(ours.bias[block], expected_bias), name
    assert targets["layers.1.self_attn.k_proj"] == ("layers.1.self_attn.qkv", 1, 3)
    assert targets["layers.0.fc2"] == ("layers.0.fc2", 0, 1)


# ------------------------------------------------------------------------------------ full shapes, on meta

@pytest.mark.parametrize("name, d_model, layers, heads, ffn, mel", [
    ("tiny.en", 384, 4, 6, 1536, 80),
    ("base", 512, 6, 8, 2048, 80),
    ("large-v3-turbo", 1280, 32, 20, 5120, 128),
])
def test_whisper_real_layouts_on_meta(name, d_model, layers, heads, ffn, mel):
    config = WhisperConfig(d_model=d_model, encoder_layers=layers, encoder_attention_heads=heads,
                           encoder_ffn_dim=ffn, num_mel_bins=mel, max_source_positions=1500,
                           decoder_layers=4, decoder_attention_heads=heads, decoder_ffn_dim=ffn,
                           vocab_size=51866 if mel == 128 else 51865)
    with torch.device("meta"):
        hf = WhisperModel(config).encoder
        tower = WhisperEncoderTower(config)
    state = dict(hf.state_dict())
    # conv1/2 (4) + positions + layer_norm (2) + 15 a layer: q/v/out_proj and fc1/fc2 weight + bias, two
    # norms, k_proj.weight
    assert len(state) == 7 + 15 * layers
    tower.load_weights(state.items())  # raises on any unknown name, wrong shape or unset parameter
    ours = sum(param.numel() for param in tower.parameters())
    assert ours == sum(tensor.numel() for tensor in state.values()) + layers * d_model  # + k's zero bias
    out = tower(torch.empty(2, mel, 3000, device="meta"))
    assert out.shape == (2, 1500, d_model)
