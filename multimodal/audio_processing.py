"""Prompt-side audio processing for encoder-decoder speech models (Whisper): decoded audio -> an encoder
input and a content hash, as ``MultiModalItem``s without a placeholder (the decoder reads the encoder
output through cross-attention; the prompt's token ids are left as they are).

The item carries the waveform (``AudioInput``); the log-mel features are computed where the encoder
runs, batched over the step's items (``AudioInput.features``: on the GPU when there is one), with the
settings that are part of the item's hash.

One item is one encoder window (30 s). Longer audio is cut into windows before it gets here
(``multimodal.audio_chunking``; the transcription API and ``LLM.transcribe`` do it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from multimodal.audio import DecodedAudio
from multimodal.audio_features import CHUNK_LENGTH_S, HOP_LENGTH, N_FFT, WHISPER_SAMPLE_RATE_HZ, Padding, WhisperLogMel
from multimodal.hashing import hash_audio
from multimodal.processing import MultiModalItem


@dataclass(frozen=True)
class AudioFeatureSettings:
    """The feature extractor's settings (``preprocessor_config.json`` of a transformers checkpoint)."""

    num_mel_bins: int = 80
    sample_rate_hz: int = WHISPER_SAMPLE_RATE_HZ
    n_fft: int = N_FFT
    hop_length: int = HOP_LENGTH
    chunk_length_s: int = CHUNK_LENGTH_S
    padding: Padding = "audio"
    """transformers' rule (pad the audio to the window, then log-mel): what the parity tests compare to."""

    @classmethod
    def read(cls, checkpoint_dir: Optional[Path], num_mel_bins: int) -> "AudioFeatureSettings":
        """From ``checkpoint_dir/preprocessor_config.json`` where it exists (faster-whisper directories
        have none: Whisper's defaults with the model's ``num_mel_bins``)."""
        path = Path(checkpoint_dir) / "preprocessor_config.json" if checkpoint_dir is not None else None
        if path is None or not path.is_file():
            return cls(num_mel_bins=num_mel_bins)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not readable JSON ({e}).") from None
        settings = cls(num_mel_bins=int(raw.get("feature_size", num_mel_bins)),
                       sample_rate_hz=int(raw.get("sampling_rate", WHISPER_SAMPLE_RATE_HZ)),
                       n_fft=int(raw.get("n_fft", N_FFT)), hop_length=int(raw.get("hop_length", HOP_LENGTH)),
                       chunk_length_s=int(raw.get("chunk_length", CHUNK_LENGTH_S)))
        if settings.num_mel_bins != num_mel_bins:
            raise ValueError(f"{path}: feature_size={settings.num_mel_bins} but the model's num_mel_bins is "
                             f"{num_mel_bins}; the checkpoint's files disagree.")
        return settings

    def key(self) -> str:
        return (f"mel{self.num_mel_bins}-sr{self.sample_rate_hz}-fft{self.n_fft}-hop{self.hop_length}"
                f"-win{self.chunk_length_s}-pad:{self.padding}")


@dataclass(frozen=True)
class AudioInput:
    """One encoder input: a mono waveform of at most one window, and the features it takes."""

    samples: np.ndarray
    """float32 [num_samples] at ``settings.sample_rate_hz``."""
    log_mel: WhisperLogMel
    """The model's feature extractor (shared by all items)."""
    padding: Padding

    @staticmethod
    def features(items: list["AudioInput"], device: torch.device) -> torch.Tensor:
        """float32 log-mel [B, num_mel_bins, frames] of ``items`` (one batched STFT on ``device``)."""
        waveforms = [torch.from_numpy(item.samples).to(device, non_blocking=True) for item in items]
        return items[0].log_mel(waveforms, padding=items[0].padding)


class AudioPromptProcessor:
    """Decoded audio -> one ``MultiModalItem`` per 30 s window (log-mel ``[num_mel_bins, frames]``).

    Args:
        settings: the feature extractor's settings.
        num_embeds: encoder output rows per item (the model's ``max_source_positions``).
    """

    modality = "audio"
    """What ``process`` takes."""
    requires_item = True
    """A prompt without audio cannot run on this model."""

    def __init__(self, settings: AudioFeatureSettings, num_embeds: int) -> None:
        self.settings = settings
        self.num_embeds = num_embeds
        self.log_mel = WhisperLogMel(settings.num_mel_bins, settings.sample_rate_hz, settings.n_fft,
                                     settings.hop_length, settings.chunk_length_s)
        self._settings_key = settings.key()

    @classmethod
    def for_whisper(cls, config, checkpoint_dir: Optional[Path]) -> "AudioPromptProcessor":
        return cls(AudioFeatureSettings.read(checkpoint_dir, config.num_mel_bins), config.max_source_positions)

    @property
    def sample_rate_hz(self) -> int:
        return self.settings.sample_rate_hz

    @property
    def window_s(self) -> float:
        """The longest audio one item takes, in seconds."""
        return float(self.settings.chunk_length_s)

    def max_embeds_per_item(self) -> int:
        return self.num_embeds

    def process(self, token_ids: list[int], audios: list[DecodedAudio]) -> tuple[list[int], list[MultiModalItem]]:
        """(decoder prompt ids, decoded audios) -> (the same ids, one item per audio).

        Raises:
            ValueError: an audio is longer than one window (cut it into windows first).
        """
        items = []
        for audio in audios:
            if audio.sample_rate_hz != self.settings.sample_rate_hz:
                raise ValueError(f"audio: decoded at {audio.sample_rate_hz} Hz, the model takes "
                                 f"{self.settings.sample_rate_hz} Hz.")
            if audio.samples.shape[0] > self.log_mel.window_samples:
                raise ValueError(
                    f"audio: {audio.duration_s:.1f} s is longer than the model's {self.window_s:.0f} s window; "
                    "transcribe long audio with LLM.transcribe() or /v1/audio/transcriptions, which cut it "
                    "into windows.")
            samples = np.ascontiguousarray(audio.samples, dtype=np.float32)
            identifier = hash_audio(samples, audio.sample_rate_hz, self._settings_key)
            items.append(MultiModalItem("audio", identifier, None, self.num_embeds,
                                        AudioInput(samples, self.log_mel, self.settings.padding)))
        return list(token_ids), items
