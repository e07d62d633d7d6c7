"""The committed test audio (tests/data/audio) and the Whisper reference helpers: every clip decodes to what
clips.json says, the compressed twins decode to nearly the wav's samples, transformers' Whisper recognises
the speech (so the data is usable to test an engine), and the helpers build what they document."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import soundfile
import torch

from multimodal.audio import AudioError, load_audio
from multimodal.audio_features import WhisperLogMel
from tests.audio.whisper_reference import (AUDIO_DIR, SAMPLE_RATE_HZ, build_tiny_random_whisper, hf_features,
                                           hf_transcribe, load_wav, normalized_words, speech_clips,
                                           whisper_tokenizer, word_error_rate)

MANIFEST = json.loads((AUDIO_DIR / "clips.json").read_text(encoding="utf-8"))
CLIPS = speech_clips()
ENGLISH_SHORT = [c.name for c in CLIPS.values() if c.language == "en" and c.duration_s <= 30.0]
TWIN_ERRORS = {"flac": 0.0, "ogg": 0.12, "mp3": 0.08, "m4a": 0.05, "webm": 0.06}
"""Largest RMS error of each twin relative to the wav's RMS (measured: 0, 0.078, 0.042, 0.025, 0.035)."""


def recognised_fraction(source: str, transcript: str) -> float:
    """The share of the source's words that appear in the transcript."""
    words, heard = normalized_words(source), set(normalized_words(transcript))
    return sum(w in heard for w in words) / len(words)


# ------------------------------------------------------------------------------------------------ the files

def test_the_manifest_lists_the_committed_files():
    names = {p.name for p in AUDIO_DIR.iterdir()}
    expected = {f"{c}.wav" for c in CLIPS} | {f"{MANIFEST['silence']['name']}.wav"}
    expected |= {f"{MANIFEST['twins']['of']}.{fmt}" for fmt in MANIFEST["twins"]["formats"]}
    assert expected | {"clips.json", "README.md", "make_audio.py"} == names
    assert sum((AUDIO_DIR / n).stat().st_size for n in names) < 3_000_000
    assert len(ENGLISH_SHORT) == 5 and {c.language for c in CLIPS.values()} == {"en", "de", "es", "fr"}
    assert max(c.duration_s for c in CLIPS.values()) > 40.0                  # one long-form clip


@pytest.mark.parametrize("name", [*CLIPS, "silence"])
def test_each_wav_is_16k_mono_pcm16_and_decodes_to_its_duration(name):
    info = soundfile.info(AUDIO_DIR / f"{name}.wav")
    assert (info.samplerate, info.channels, info.subtype) == (SAMPLE_RATE_HZ, 1, "PCM_16")
    decoded = load_audio(AUDIO_DIR / f"{name}.wav")
    samples, rate = load_wav(name)
    assert decoded.source_format == "wav" and rate == SAMPLE_RATE_HZ
    np.testing.assert_array_equal(decoded.samples, samples)                 # 16 kHz in: no resampling
    expected_s = CLIPS[name].duration_s if name in CLIPS else MANIFEST["silence"]["duration_s"]
    assert decoded.duration_s == pytest.approx(expected_s, abs=1e-4)
    if name == "silence":
        assert not decoded.samples.any()
    else:
        assert 0.1 < np.abs(samples).max() <= 1.0


@pytest.mark.parametrize("fmt", MANIFEST["twins"]["formats"])
def test_compressed_twins_decode_to_nearly_the_wav(fmt):
    name = MANIFEST["twins"]["of"]
    reference, _ = load_wav(name)
    decoded = load_audio(AUDIO_DIR / f"{name}.{fmt}")
    assert decoded.sample_rate_hz == SAMPLE_RATE_HZ and decoded.num_source_channels == 1
    assert abs(decoded.samples.shape[0] - reference.shape[0]) <= 8     # encoder delay and padding dropped
    n = min(decoded.samples.shape[0], reference.shape[0])
    error = np.sqrt(np.mean((decoded.samples[:n] - reference[:n]) ** 2) / np.mean(reference[:n] ** 2))
    assert error <= TWIN_ERRORS[fmt]
    expected_format = {"ogg": "ogg/vorbis", "m4a": "mp4/aac", "webm": "matroska/opus"}.get(fmt, fmt)
    assert decoded.source_format == expected_format


def test_broken_files_are_refused_with_a_reason():
    data = (AUDIO_DIR / "fox.wav").read_bytes()
    with pytest.raises(AudioError, match=r"starts like wav audio but its header could not be read, it is "
                                         r"corrupt or truncated \(Channel count is zero\)"):
        load_audio(data[:22] + struct.pack("<H", 0) + data[24:])                 # fmt chunk: 0 channels
    with pytest.raises(AudioError, match=r"corrupt or truncated \(Error in WAV file. No 'data' chunk"):
        load_audio(data[:30])
    with pytest.raises(AudioError, match=r"^the data is not audio in a supported format"):
        load_audio((AUDIO_DIR / "README.md").read_bytes())


# ------------------------------------------------------------------------------------ the reference helpers

@pytest.mark.parametrize("padding", ["audio", "features"])
def test_hf_features_are_the_front_ends_log_mel(padding):
    """The reference's features (transformers' extractor) equal ``WhisperLogMel``'s under both rules."""
    samples, _ = load_wav("hello")
    reference = hf_features(samples, 80, padding)
    ours = WhisperLogMel(80)(samples, padding=padding)
    assert reference.shape == ours.shape == (1, 80, 3000)
    torch.testing.assert_close(reference, ours, atol=2e-4, rtol=0)


def test_word_error_rate():
    assert word_error_rate("The quick brown fox.", "the quick brown fox") == 0.0
    assert word_error_rate("a b c d", "a x c") == 0.5                  # one substitution, one deletion
    assert recognised_fraction("Hello world, hello.", " Hello there") == pytest.approx(2 / 3)


# -------------------------------------------------------------------------------- real Whisper on the clips

def test_tiny_en_recognises_the_short_english_clips(tiny_en):
    for name in ENGLISH_SHORT:
        samples, _ = load_wav(name)
        result = hf_transcribe(tiny_en.model, tiny_en.tokenizer, samples, max_new_tokens=60)
        assert result.prompt_ids == [50257, 50362]                               # sot, notimestamps
        assert recognised_fraction(CLIPS[name].text, result.text) >= 0.7, (name, result.text)
        token_ids, text = result                                                 # unpacks as (ids, text)
        assert text == result.text and 50256 not in token_ids and max(token_ids) < 50257


def test_tiny_en_transcribes_the_long_clip_long_form(tiny_en):
    samples, _ = load_wav("long")
    result = hf_transcribe(tiny_en.model, tiny_en.tokenizer, samples, timestamps=True)
    assert result.prompt_ids == [50257] and result.features.shape == (1, 80, samples.shape[0] // 160)
    assert recognised_fraction(CLIPS["long"].text, result.text) >= 0.8, result.text
    assert "finally" in normalized_words(result.text)                           # the second window too
    assert sum(t >= 50363 for t in result.token_ids) >= 4                       # timestamp tokens
    with pytest.raises(ValueError, match="needs timestamps=True"):
        hf_transcribe(tiny_en.model, tiny_en.tokenizer, samples)


def test_base_detects_each_clips_language(base):
    model = base.model
    for name in ["german", "french"]:
        samples, _ = load_wav(name)
        lang_id = int(model.detect_language(hf_features(samples, 80).to(model.dtype))[0])
        assert lang_id == model.config.lang_to_id[f"<|{CLIPS[name].language}|>"], name
    samples, _ = load_wav("spanish")
    result = hf_transcribe(model, base.tokenizer, samples, max_new_tokens=12)   # detects, then transcribes
    assert result.language == "es" and result.prompt_ids == [50258, 50262, 50359, 50363]
    assert result.text.startswith(" Buenos días, me llamo María"), result.text


# ------------------------------------------------------------------------------- the tiny random checkpoint

def test_tiny_random_whisper_is_a_transformers_checkpoint(tiny_random_whisper_dir, tiny_en_dir):
    from transformers import (AutoFeatureExtractor, AutoTokenizer, GenerationConfig,
                              WhisperForConditionalGeneration)

    model = WhisperForConditionalGeneration.from_pretrained(tiny_random_whisper_dir)
    c = model.config
    assert (c.vocab_size, c.d_model, c.encoder_layers, c.decoder_attention_heads, c.num_mel_bins) == \
        (51864, 64, 2, 4, 80)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    generation = GenerationConfig.from_pretrained(tiny_random_whisper_dir)
    assert generation.decoder_start_token_id == 50257 and generation.eos_token_id == 50256
    assert generation.no_timestamps_token_id == 50362
    assert AutoFeatureExtractor.from_pretrained(tiny_random_whisper_dir).feature_size == 80
    tokenizer = AutoTokenizer.from_pretrained(tiny_random_whisper_dir)
    text = " Hello world, it's 9 o'clock."
    assert type(tokenizer).__name__ == "WhisperTokenizer" and len(tokenizer) == 51864
    assert tokenizer.encode(text, add_special_tokens=False) == \
        whisper_tokenizer(tiny_en_dir).encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|1.00|>") == 50363 + 50
    out = model.generate(torch.randn(1, 80, 3000), max_new_tokens=4)
    assert out.shape == (1, 4)


def test_tiny_random_whisper_options(tmp_path):
    from transformers import WhisperForConditionalGeneration

    directory = build_tiny_random_whisper(tmp_path, multilingual=True, encoder_heads=2, decoder_heads=8,
                                          encoder_ffn=96, tie=False, scale_embedding=True, num_mel_bins=128,
                                          max_source_positions=750, seed=3)
    model = WhisperForConditionalGeneration.from_pretrained(directory)
    c = model.config
    assert (c.vocab_size, c.encoder_attention_heads, c.decoder_attention_heads, c.encoder_ffn_dim,
            c.decoder_ffn_dim, c.scale_embedding, c.num_mel_bins, c.max_source_positions) == \
        (51865, 2, 8, 96, 128, True, 128, 750)
    assert not c.tie_word_embeddings
    assert not torch.equal(model.proj_out.weight, model.model.decoder.embed_tokens.weight)
    assert json.loads((directory / "preprocessor_config.json").read_text())["feature_size"] == 128
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["lang_to_id"]["<|de|>"] == 50261 and generation["is_multilingual"]
    out = model.generate(torch.randn(1, 128, 1500), language="de", max_new_tokens=3)
    assert out.shape[0] == 1
