"""multimodal/audio_features.py: parity with transformers' ``WhisperFeatureExtractor`` (80 and 128 mel bins,
short, exactly 30 s, odd lengths, batches of different lengths), and the faster-whisper padding rule against
references built from transformers' pieces and from numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank as transformers_mel_filter_bank

from multimodal.audio_features import WhisperLogMel, mel_filter_bank, num_frames

WINDOW_SAMPLES = 480_000
TOLERANCE = 1e-4


def speech_like(num_samples: int, seed: int) -> np.ndarray:
    """float32 [num_samples]: a tone swept in loudness, plus noise (every mel band gets energy)."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 16000
    signal = 0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) * np.sin(2 * np.pi * 0.7 * t) \
        + 0.02 * rng.standard_normal(num_samples)
    return signal.astype(np.float32)


@pytest.fixture(scope="module", params=[80, 128])
def extractors(request):
    """(ours, transformers') for one mel-bin count."""
    return WhisperLogMel(request.param), WhisperFeatureExtractor(feature_size=request.param)


def transformers_features(extractor: WhisperFeatureExtractor, waveforms: list[np.ndarray],
                          **kwargs) -> np.ndarray:
    return extractor(waveforms, sampling_rate=16000, return_tensors="np", **kwargs).input_features


def faster_whisper_reference(waveform: np.ndarray, mel_filters: np.ndarray) -> np.ndarray:
    """faster-whisper 1.x's ``FeatureExtractor.__call__`` then ``pad_or_trim(features[:, :content_frames])``,
    written out in float64 numpy: content + 160 zeros, a centred reflect-padded STFT with a periodic Hann
    window, the last frame dropped, floor at max - 8 over all frames, the first ``len // 160`` frames kept
    and padded with 0.0 to 3000."""
    padded = np.pad(waveform.astype(np.float64), (0, 160))
    padded = np.pad(padded, (200, 200), mode="reflect")
    frame_count = 1 + (padded.shape[0] - 400) // 160
    frames = np.lib.stride_tricks.sliding_window_view(padded, 400)[::160][:frame_count]   # [frames, 400]
    window = np.hanning(401)[:-1]
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2                          # [frames, 201]
    log_spec = np.log10(np.maximum(mel_filters.T @ power[:-1].T, 1e-10))                # [mels, frames - 1]
    log_spec = (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0
    content_frames = waveform.shape[0] // 160
    out = np.zeros((mel_filters.shape[1], 3000))
    out[:, :content_frames] = log_spec[:, :content_frames]
    return out


@pytest.mark.parametrize("num_mel_bins", [80, 128])
def test_filter_bank_equals_transformers(num_mel_bins):
    ours = mel_filter_bank(num_mel_bins)
    reference = transformers_mel_filter_bank(201, num_mel_bins, 0.0, 8000.0, 16000, norm="slaney",
                                             mel_scale="slaney")
    assert ours.shape == (201, num_mel_bins) and ours.dtype == np.float64
    np.testing.assert_allclose(ours, reference, rtol=1e-12, atol=1e-15)


def test_num_frames():
    assert num_frames(480_000) == 3000
    assert num_frames(12_345) == 77
    assert num_frames(159) == 0 and num_frames(160) == 1 and num_frames(0) == 0


@pytest.mark.parametrize("num_samples", [16000 * 2 + 17, WINDOW_SAMPLES, 12_345, 1])
def test_audio_padding_equals_transformers(extractors, num_samples):
    ours, theirs = extractors
    waveform = speech_like(num_samples, seed=1)
    features = ours(waveform)
    assert features.shape == (1, ours.num_mel_bins, 3000) and features.dtype == torch.float32
    reference = transformers_features(theirs, [waveform])
    assert np.abs(features.numpy() - reference).max() <= TOLERANCE


def test_a_batch_of_different_lengths_equals_transformers(extractors):
    ours, theirs = extractors
    waveforms = [speech_like(n, seed) for seed, n in enumerate([48_017, WINDOW_SAMPLES, 12_345, 100_001])]
    features = ours(waveforms)
    reference = transformers_features(theirs, waveforms)
    assert features.shape == reference.shape == (4, ours.num_mel_bins, 3000)
    assert np.abs(features.numpy() - reference).max() <= TOLERANCE
    # Each item's floor is its own: the batch gives what each waveform gives alone.
    for row, waveform in enumerate(waveforms):
        assert torch.equal(features[row], ours([waveform])[0])


def test_silence_is_the_floor(extractors):
    ours, theirs = extractors
    features = ours(np.zeros(8000, np.float32))
    assert torch.all(features == -1.5)   # log10(1e-10) = -10, (-10 + 4) / 4
    assert np.abs(transformers_features(theirs, [np.zeros(8000, np.float32)]) + 1.5).max() == 0


def test_features_padding_equals_the_reference_from_transformers_pieces(extractors):
    """transformers' extractor on the content plus 160 zeros, without padding ("longest" of one), gives
    faster-whisper's ``num_samples // 160 + 1`` frames; the first ``num_samples // 160`` are kept and the
    window is filled with 0.0."""
    ours, theirs = extractors
    lengths = [48_017, WINDOW_SAMPLES, 12_345, 479_999]
    waveforms = [speech_like(n, seed) for seed, n in enumerate(lengths)]
    features = ours(waveforms, padding="features")
    assert features.shape == (4, ours.num_mel_bins, 3000)
    for row, waveform in enumerate(waveforms):
        content = np.concatenate([waveform, np.zeros(160, np.float32)])
        frames = transformers_features(theirs, [content], padding="longest",
                                       max_length=WINDOW_SAMPLES + 160)[0]
        assert frames.shape[-1] == num_frames(waveform.shape[0]) + 1
        expected = np.zeros((ours.num_mel_bins, 3000), np.float32)
        kept = num_frames(waveform.shape[0])
        expected[:, :kept] = frames[:, :kept]
        assert np.abs(features[row].numpy() - expected).max() <= TOLERANCE
        assert not features[row, :, kept:].any()


def test_features_padding_equals_faster_whisper_in_numpy():
    ours = WhisperLogMel(80)
    for seed, num_samples in enumerate([35_000, WINDOW_SAMPLES, 7_777]):
        waveform = speech_like(num_samples, seed)
        features = ours(waveform, padding="features")[0].numpy()
        reference = faster_whisper_reference(waveform, ours.mel_filters)
        assert np.abs(features - reference).max() <= TOLERANCE


def test_features_padding_of_less_than_one_hop_is_all_zero():
    features = WhisperLogMel(80)([np.ones(100, np.float32)], padding="features")
    assert features.shape == (1, 80, 3000) and not features.any()


def test_padding_rules_on_a_full_window_differ_only_in_the_last_frame():
    """On exactly 30 s the rules see the same samples except past the end: the last frame's window reaches
    40 samples beyond the audio, which transformers reflect-pads with content and faster-whisper fills with
    its 160 zeros. (The floor could differ too, were the loudest frame the extra one; here it is not.)"""
    ours = WhisperLogMel(80)
    waveform = speech_like(WINDOW_SAMPLES, seed=3)
    audio_padded, features_padded = ours(waveform), ours(waveform, padding="features")
    assert torch.equal(audio_padded[..., :-1], features_padded[..., :-1])
    assert (audio_padded[..., -1] - features_padded[..., -1]).abs().max() > 1e-4


def test_padded_rows_with_num_samples(extractors):
    ours, _ = extractors
    lengths = [20_000, 33_333, 160]
    waveforms = [speech_like(n, seed) for seed, n in enumerate(lengths)]
    padded = torch.full((3, 40_000), 0.5)   # garbage past each length must be ignored
    for row, waveform in enumerate(waveforms):
        padded[row, :waveform.shape[0]] = torch.from_numpy(waveform)
    for padding in ("audio", "features"):
        assert torch.equal(ours(padded, num_samples=lengths, padding=padding),
                           ours(waveforms, padding=padding))


def test_input_kinds_give_the_same_features():
    ours = WhisperLogMel(80)
    waveform = speech_like(16_000, seed=4)
    expected = ours(waveform)
    assert torch.equal(ours(torch.from_numpy(waveform)), expected)
    assert torch.equal(ours(waveform[None]), expected)
    assert torch.equal(ours([torch.from_numpy(waveform)]), expected)
    assert torch.allclose(ours(waveform.astype(np.float64)), expected, rtol=0, atol=1e-6)


def test_refuses_more_than_one_window_and_bad_arguments():
    ours = WhisperLogMel(80)
    with pytest.raises(ValueError, match=r"480001 samples, more than the 480000 \(30 s\) of one window"):
        ours(np.zeros(WINDOW_SAMPLES + 1, np.float32))
    with pytest.raises(ValueError, match=r"padding must be 'audio' or 'features'"):
        ours(np.zeros(100, np.float32), padding="longest")
    with pytest.raises(ValueError, match=r"num_samples must give each of the 2 rows a length in 0\.\.100"):
        ours(np.zeros((2, 100), np.float32), num_samples=[50, 101])
    with pytest.raises(ValueError, match=r"must be \[num_samples\] or \[B, num_samples\]"):
        ours(np.zeros((1, 2, 100), np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_equals_cpu():
    ours = WhisperLogMel(128)
    waveforms = [speech_like(n, seed) for seed, n in enumerate([48_017, WINDOW_SAMPLES])]
    for padding in ("audio", "features"):
        on_cpu = ours(waveforms, padding=padding)
        on_cuda = ours([torch.from_numpy(w).cuda() for w in waveforms], padding=padding)
        assert on_cuda.device.type == "cuda"
        assert (on_cuda.cpu() - on_cpu).abs().max() <= TOLERANCE
