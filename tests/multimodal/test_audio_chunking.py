"""multimodal/audio_chunking.py: cuts land in silent gaps, or at the quietest 100 ms found by brute force;
chunks are contiguous, cover the audio once, never exceed 30 s, and carry exact sample offsets."""

from __future__ import annotations

import numpy as np
import pytest

from multimodal.audio_chunking import AudioChunk, chunk_audio

RATE_HZ = 16000
WINDOW = 30 * RATE_HZ       # samples in 30 s
SEARCH = RATE_HZ            # the last second
RMS = RATE_HZ // 10         # 100 ms


def noise(num_samples: int, seed: int = 0) -> np.ndarray:
    """float32 [num_samples] of white noise: no two 100 ms windows are equally loud."""
    return np.random.default_rng(seed).standard_normal(num_samples, dtype=np.float32) * np.float32(0.1)


def check_partition(chunks: list[AudioChunk], num_samples: int) -> None:
    """Contiguous, exactly covering [0, num_samples), at most 30 s each, times from sample counts."""
    assert chunks[0].start_sample == 0 and chunks[-1].end_sample == num_samples
    for previous, chunk in zip(chunks, chunks[1:]):
        assert chunk.start_sample == previous.end_sample
    for chunk in chunks:
        assert 0 < chunk.num_samples <= WINDOW
        assert chunk.start_s == chunk.start_sample / RATE_HZ and chunk.end_s == chunk.end_sample / RATE_HZ
    for chunk in chunks[:-1]:   # a cut is always inside the last second of its window
        assert WINDOW - SEARCH + RMS // 2 <= chunk.num_samples <= WINDOW - RMS // 2


def brute_force_cut(samples: np.ndarray, chunk_start: int) -> int:
    """The centre of the lowest-RMS 100 ms window lying wholly in the last second of the 30 s window that
    starts at ``chunk_start``, every start position tried, RMS computed directly."""
    segment = samples[chunk_start + WINDOW - SEARCH:chunk_start + WINDOW].astype(np.float64)
    windows = np.lib.stride_tricks.sliding_window_view(segment, RMS)           # [SEARCH - RMS + 1, RMS]
    rms = np.sqrt(np.mean(windows ** 2, axis=1))
    return chunk_start + WINDOW - SEARCH + int(np.argmin(rms)) + RMS // 2


def test_cuts_land_mid_gap_in_a_75_s_recording():
    """Silent gaps of 300 ms and 400 ms sit in the last second of the first and second windows: each cut is
    at the middle of its gap, to the sample (the middle one of the equally silent 100 ms windows)."""
    samples = noise(75 * RATE_HZ)
    first_gap = (int(29.3 * RATE_HZ), int(29.6 * RATE_HZ))
    samples[first_gap[0]:first_gap[1]] = 0.0
    first_cut = first_gap[0] + (first_gap[1] - RMS - first_gap[0]) // 2 + RMS // 2
    second_gap = (first_cut + int(29.2 * RATE_HZ), first_cut + int(29.6 * RATE_HZ))
    samples[second_gap[0]:second_gap[1]] = 0.0
    second_cut = second_gap[0] + (second_gap[1] - RMS - second_gap[0]) // 2 + RMS // 2

    chunks = chunk_audio(samples)
    check_partition(chunks, samples.shape[0])
    assert [c.end_sample for c in chunks] == [first_cut, second_cut, 75 * RATE_HZ]
    assert first_gap[0] + RMS // 2 <= first_cut <= first_gap[1] - RMS // 2
    assert second_gap[0] + RMS // 2 <= second_cut <= second_gap[1] - RMS // 2
    # The 100 ms around each cut is digital silence.
    for cut in (first_cut, second_cut):
        assert not samples[cut - RMS // 2:cut + RMS // 2].any()
    assert chunks[0].end_s == first_cut / RATE_HZ == 29.45


def test_without_gaps_the_cut_is_the_quietest_window_in_the_last_second():
    """Noise under a slow loudness envelope: no silence anywhere, each cut is where brute force puts it."""
    num_samples = 75 * RATE_HZ + 123
    t = np.arange(num_samples) / RATE_HZ
    envelope = 1.2 + np.sin(2 * np.pi * t / 7.3)                    # quiet stretches not aligned to windows
    samples = (noise(num_samples, seed=1) * envelope).astype(np.float32)
    chunks = chunk_audio(samples)
    check_partition(chunks, num_samples)
    assert len(chunks) == 3
    for chunk in chunks[:-1]:
        assert chunk.end_sample == brute_force_cut(samples, chunk.start_sample)


def test_a_quiet_spot_outside_the_last_second_is_not_used():
    samples = noise(40 * RATE_HZ, seed=2)
    samples[int(28.0 * RATE_HZ):int(28.5 * RATE_HZ)] = 0.0   # silence, but before the last second
    chunks = chunk_audio(samples)
    check_partition(chunks, samples.shape[0])
    assert chunks[0].end_sample == brute_force_cut(samples, 0) > 29 * RATE_HZ


def test_short_and_boundary_lengths():
    assert chunk_audio(np.zeros(0, np.float32)) == []
    assert chunk_audio(noise(5 * RATE_HZ)) == [AudioChunk(0, 5 * RATE_HZ, 0.0, 5.0)]
    assert chunk_audio(noise(WINDOW)) == [AudioChunk(0, WINDOW, 0.0, 30.0)]   # exactly 30 s is one chunk
    chunks = chunk_audio(noise(WINDOW + 1))
    check_partition(chunks, WINDOW + 1)
    assert len(chunks) == 2 and chunks[1].num_samples < SEARCH + 1


def test_an_hour_has_exact_offsets_and_no_drift():
    """An hour of low noise (a tone would make ties): offsets are sample counts, times are those over the
    rate, and the chunks reassemble the samples exactly."""
    samples = noise(3600 * RATE_HZ + 7, seed=3)
    chunks = chunk_audio(samples)
    check_partition(chunks, samples.shape[0])
    assert 121 <= len(chunks) <= 125
    assert chunks[-1].end_s == 3600 + 7 / RATE_HZ
    assert np.array_equal(np.concatenate([samples[c.start_sample:c.end_sample] for c in chunks]), samples)


def test_other_rates_and_arguments():
    samples = noise(70 * 8000, seed=4)
    chunks = chunk_audio(samples, sample_rate_hz=8000)
    assert chunks[-1].end_sample == 70 * 8000 and all(c.num_samples <= 30 * 8000 for c in chunks)
    assert chunks[0].end_sample == chunks[1].start_sample and chunks[0].end_s == chunks[0].end_sample / 8000
    with pytest.raises(ValueError, match=r"samples must be mono \[num_samples\], got shape \[10, 2\]"):
        chunk_audio(np.zeros((10, 2), np.float32))
    with pytest.raises(ValueError, match=r"need 0 < rms_window_s <= search_s <= chunk_length_s"):
        chunk_audio(samples, search_s=0.05)
