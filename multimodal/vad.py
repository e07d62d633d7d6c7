"""Voice-activity chunking (``--audio-chunking vad``): silero-vad finds the speech, and only speech is
transcribed, in windows that split between utterances.

silero-vad's ONNX model (shipped inside the ``silero-vad`` wheel) runs through onnxruntime on 16 kHz audio,
512 samples (32 ms) per step with the previous step's last 64 samples as context and a recurrent state
carried over, giving each step a speech probability. Regions are read from those as silero-vad's
``get_speech_timestamps`` does (``speech_regions``): speech starts at a step above ``threshold``, ends after
``min_silence_s`` below ``threshold - 0.15``; regions shorter than ``min_speech_s`` are dropped; each is
padded by ``speech_pad_s`` on both sides, at most to the middle of the gap to its neighbour. The defaults
are faster-whisper's for Whisper (a pause under 2 s stays inside the region, 0.4 s of padding).

``VoiceChunker.chunks`` then makes each region a window (its own engine request; they run in parallel), so
every cut falls in a silence of at least ``min_silence_s`` and no silence that long is transcribed; a region
longer than a window is cut inside by the quiet chunker. Audio without speech has no chunks. Chunk offsets
are samples of the original audio, so the transcript's times are the recording's.

The ONNX runtime is made on first use in each process (it does not pickle; the transcriber travels to the
API process in the engine-process mode).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from multimodal.audio_chunking import AudioChunk, chunk_audio

VAD_SAMPLE_RATE_HZ = 16000
"""silero-vad runs on 16 kHz audio here (Whisper's rate)."""
STEP_SAMPLES = 512
"""Samples per model step (32 ms)."""
CONTEXT_SAMPLES = 64
"""Samples of the previous step given with each step."""
STATE_SHAPE = (2, 1, 128)
"""The model's recurrent state [2, batch, 128]."""
INSTALL_HINT = "pip install 'chorus[vad]' (silero-vad and onnxruntime)"
"""How to get the packages ``--audio-chunking vad`` needs."""


class VadUnavailableError(ValueError):
    """silero-vad or onnxruntime is not installed."""


def silero_model_path() -> Path:
    """The ONNX model inside the installed ``silero-vad`` package (the package is not imported: its
    ``__init__`` imports torch utilities it does not need here). VadUnavailableError when missing."""
    missing = [name for name in ("onnxruntime", "silero_vad") if importlib.util.find_spec(name) is None]
    if missing:
        raise VadUnavailableError(f"--audio-chunking vad needs {' and '.join(missing)}, which is not installed; "
                                  f"run: {INSTALL_HINT}, or use --audio-chunking quiet.")
    spec = importlib.util.find_spec("silero_vad")
    path = Path(spec.origin).parent / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise VadUnavailableError(f"--audio-chunking vad: the silero-vad package has no {path.name}; reinstall "
                                  f"it ({INSTALL_HINT}), or use --audio-chunking quiet.")
    return path


@dataclass(frozen=True)
class VadSettings:
    """How speech probabilities become regions (silero-vad's ``get_speech_timestamps`` parameters)."""

    threshold: float = 0.5
    """A step at or above this probability is speech."""
    min_speech_s: float = 0.25
    """Shorter regions are dropped."""
    min_silence_s: float = 2.0
    """A region ends only after this much audio below ``threshold - 0.15``."""
    speech_pad_s: float = 0.4
    """Audio kept before and after each region (at most half the gap to the next one)."""


def speech_regions(probabilities: np.ndarray, num_samples: int,
                   settings: VadSettings = VadSettings()) -> list[tuple[int, int]]:
    """probabilities [num_steps] (one per ``STEP_SAMPLES``) -> [(start_sample, end_sample)] of the speech,
    padded, in order, not overlapping, within ``[0, num_samples)``."""
    rate = VAD_SAMPLE_RATE_HZ
    negative = settings.threshold - 0.15
    min_silence = settings.min_silence_s * rate
    regions: list[list[int]] = []
    start: Optional[int] = None
    silence_from: Optional[int] = None
    for step, p in enumerate(probabilities):
        position = step * STEP_SAMPLES
        if p >= settings.threshold:
            silence_from = None
            if start is None:
                start = position
        elif start is not None and p < negative:
            if silence_from is None:
                silence_from = position
            if position - silence_from >= min_silence:
                regions.append([start, silence_from])
                start, silence_from = None, None
    if start is not None:
        regions.append([start, num_samples])
    regions = [r for r in regions if r[1] - r[0] >= settings.min_speech_s * rate]
    pad = int(settings.speech_pad_s * rate)
    for i, region in enumerate(regions):
        before = region[0] if i == 0 else (region[0] - regions[i - 1][1]) // 2
        region[0] -= min(pad, before)
        if i + 1 < len(regions):
            region[1] += min(pad, (regions[i + 1][0] - region[1]) // 2)
        else:
            region[1] = min(num_samples, region[1] + pad)
    return [(int(a), int(b)) for a, b in regions]


def pack_regions(regions: list[tuple[int, int]], sample_rate_hz: int, chunk_length_s: float,
                 samples: np.ndarray) -> list[AudioChunk]:
    """One chunk per speech region; a region longer than ``chunk_length_s`` is cut by ``chunk_audio``."""
    spans: list[tuple[int, int]] = []
    for start, end in regions:
        spans += [(start + c.start_sample, start + c.end_sample)
                  for c in chunk_audio(samples[start:end], sample_rate_hz, chunk_length_s)]
    return [AudioChunk(a, b, a / sample_rate_hz, b / sample_rate_hz) for a, b in spans]


@dataclass
class VoiceChunker:
    """``--audio-chunking vad``: chunks of speech only (see the module docstring)."""

    model_path: Path
    """silero-vad's ONNX model."""
    settings: VadSettings = VadSettings()
    _runtime: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls) -> "VoiceChunker":
        """A chunker over the installed model; VadUnavailableError (with the install command) without it."""
        chunker = cls(silero_model_path())
        chunker._get_runtime()    # fail at start-up, not on the first request
        return chunker

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path, "settings": self.settings, "_runtime": None}

    def _get_runtime(self):
        if self._runtime is None:
            try:
                import onnxruntime
            except ImportError as e:
                raise VadUnavailableError(f"--audio-chunking vad needs onnxruntime ({e}); run: {INSTALL_HINT}.") from e
            options = onnxruntime.SessionOptions()
            options.inter_op_num_threads = 1
            options.intra_op_num_threads = 1
            self._runtime = onnxruntime.InferenceSession(str(self.model_path), sess_options=options,
                                                         providers=["CPUExecutionProvider"])
        return self._runtime

    def speech_probabilities(self, samples: np.ndarray) -> np.ndarray:
        """float32 mono 16 kHz ``samples`` [num_samples] -> speech probability per 512-sample step
        [ceil(num_samples / 512)] (the last step zero-padded)."""
        runtime = self._get_runtime()
        samples = np.asarray(samples, dtype=np.float32)
        num_steps = -(-samples.shape[0] // STEP_SAMPLES)
        padded = np.zeros(num_steps * STEP_SAMPLES + CONTEXT_SAMPLES, dtype=np.float32)
        padded[CONTEXT_SAMPLES:CONTEXT_SAMPLES + samples.shape[0]] = samples
        state = np.zeros(STATE_SHAPE, dtype=np.float32)
        rate = np.array(VAD_SAMPLE_RATE_HZ, dtype=np.int64)
        probabilities = np.empty(num_steps, dtype=np.float32)
        for step in range(num_steps):
            frame = padded[step * STEP_SAMPLES:(step + 1) * STEP_SAMPLES + CONTEXT_SAMPLES][None, :]   # [1, 576]
            out, state = runtime.run(None, {"input": frame, "state": state, "sr": rate})
            probabilities[step] = float(out.reshape(-1)[0])
        return probabilities

    def chunks(self, samples: np.ndarray, sample_rate_hz: int, chunk_length_s: float) -> list[AudioChunk]:
        if sample_rate_hz != VAD_SAMPLE_RATE_HZ:
            raise ValueError(f"voice-activity chunking takes {VAD_SAMPLE_RATE_HZ} Hz audio, got {sample_rate_hz} Hz.")
        regions = speech_regions(self.speech_probabilities(samples), samples.shape[0], self.settings)
        return pack_regions(regions, sample_rate_hz, chunk_length_s, samples)
