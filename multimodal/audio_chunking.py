"""Splitting long audio into contiguous chunks of at most one Whisper window (30 s), cut where it is quiet.

Audio of at most ``chunk_length_s`` is one chunk. Longer audio is cut greedily: from a chunk's start, the
next cut is placed inside the last ``search_s`` (1 s) of the ``chunk_length_s`` window that starts there, at
the centre of the quietest ``rms_window_s`` (100 ms) window lying wholly in that last second (the one with
the lowest RMS, every sample position tried). Where several windows are equally quiet (a gap of digital
silence longer than 100 ms) the middle one of them is taken, so the cut falls mid-gap. This repeats until
what is left fits in one window, which becomes the final chunk: no chunk exceeds ``chunk_length_s``, and
every chunk but the last is at least ``chunk_length_s - search_s + rms_window_s / 2`` long.

Chunks are computed in whole samples and their times derived from those (``start_sample / rate``), so
offsets do not drift over an hour; together they cover ``[0, num_samples)`` exactly once, each starting
where the previous ended.

That is the ``quiet`` chunker (``QuietChunker``, the default of ``--audio-chunking``). The ``vad`` one
(``multimodal.vad.VoiceChunker``) keeps only the speech silero-vad finds, so its chunks may leave gaps;
``engine.transcription.audio_chunker(mode)`` gives either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

CHUNK_LENGTH_S = 30.0
"""Longest chunk: Whisper's window."""
SEARCH_S = 1.0
"""Cuts are searched in this last stretch of each window."""
RMS_WINDOW_S = 0.1
"""The loudness of a candidate cut is the RMS of this much audio around it."""


@dataclass(frozen=True)
class AudioChunk:
    """One chunk, ``samples[start_sample:end_sample]``."""

    start_sample: int
    """First sample of the chunk."""
    end_sample: int
    """One past its last sample: the next chunk's ``start_sample``."""
    start_s: float
    """``start_sample / sample_rate_hz``."""
    end_s: float
    """``end_sample / sample_rate_hz``."""

    @property
    def num_samples(self) -> int:
        return self.end_sample - self.start_sample


AUDIO_CHUNKING_MODES = ("quiet", "vad")
"""``--audio-chunking`` values."""


class AudioChunker(Protocol):
    """Long audio -> the chunks to transcribe, in order, each at most ``chunk_length_s``."""

    def chunks(self, samples: np.ndarray, sample_rate_hz: int, chunk_length_s: float) -> list[AudioChunk]:
        ...


@dataclass(frozen=True)
class QuietChunker:
    """Contiguous chunks cut at quiet points (``chunk_audio``): every sample is transcribed."""

    def chunks(self, samples: np.ndarray, sample_rate_hz: int, chunk_length_s: float) -> list[AudioChunk]:
        return chunk_audio(samples, sample_rate_hz, chunk_length_s)


def chunk_audio(samples: np.ndarray, sample_rate_hz: int = 16000, chunk_length_s: float = CHUNK_LENGTH_S,
                search_s: float = SEARCH_S, rms_window_s: float = RMS_WINDOW_S) -> list[AudioChunk]:
    """Contiguous chunks of mono ``samples`` (``[num_samples]``), each at most ``chunk_length_s``, cut at the
    quietest ``rms_window_s`` window in the last ``search_s`` of each window (see the module docstring).
    Empty audio has no chunks."""
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise ValueError(f"samples must be mono [num_samples], got shape {list(samples.shape)}")
    window_samples = int(round(chunk_length_s * sample_rate_hz))
    search_samples = int(round(search_s * sample_rate_hz))
    rms_samples = int(round(rms_window_s * sample_rate_hz))
    if not 0 < rms_samples <= search_samples <= window_samples:
        raise ValueError(f"need 0 < rms_window_s <= search_s <= chunk_length_s at {sample_rate_hz} Hz, got "
                         f"{rms_window_s}, {search_s}, {chunk_length_s}")
    num_samples = samples.shape[0]
    cuts = [0]
    while num_samples - cuts[-1] > window_samples:
        window_end = cuts[-1] + window_samples
        cuts.append(quietest_cut(samples[window_end - search_samples:window_end], rms_samples)
                    + window_end - search_samples)
    cuts.append(num_samples)
    if num_samples == 0:
        return []
    return [AudioChunk(start, end, start / sample_rate_hz, end / sample_rate_hz)
            for start, end in zip(cuts[:-1], cuts[1:])]


def quietest_cut(segment: np.ndarray, rms_samples: int) -> int:
    """The offset in ``segment`` of the centre of its quietest ``rms_samples`` window (the middle one of
    equally quiet windows). Comparing sums of squares orders windows as their RMS does."""
    squares = np.square(segment, dtype=np.float64)
    cumulative = np.concatenate([[0.0], np.cumsum(squares)])                  # [len + 1]
    energies = cumulative[rms_samples:] - cumulative[:-rms_samples]           # [len - rms + 1], per start
    # Differences of a running sum carry its rounding: windows within a few ulps of the total tie.
    tolerance = 8 * np.finfo(np.float64).eps * cumulative[-1]
    quietest = np.flatnonzero(energies <= energies.min() + tolerance)
    return int(quietest[len(quietest) // 2]) + rms_samples // 2
