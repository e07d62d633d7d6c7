"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) prompt side: each audio of a prompt becomes a run of
``<|AUDIO|>`` tokens, one per encoder embedding, and an item carrying its waveform.

As transformers' ``Qwen2AudioProcessor``: the feature extractor (Whisper's, ``padding="max_length"``) pads
the audio to the 30 s window and takes its log-mel; the frames of content are ``ceil(num_samples / hop)``
(its attention mask, one entry per hop); the embeddings are those frames after conv2's stride 2 and the
average pooling by 2 (``encoders.qwen2_audio.num_audio_embeds``). Each ``<|AUDIO|>`` of the prompt (what
the chat template renders, between ``<|audio_bos|>`` and ``<|audio_eos|>``) is expanded to that many; a
prompt that already holds the expanded runs is kept as it is.

Audio longer than the window is refused (transformers' processor would cut it silently), and so is audio
too short to make one embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from encoders.qwen2_audio import num_audio_embeds
from multimodal.audio import DecodedAudio
from multimodal.audio_features import WhisperLogMel
from multimodal.audio_processing import AudioFeatureSettings, AudioInput
from multimodal.hashing import hash_audio
from multimodal.processing import MultiModalItem, expand_placeholders


@dataclass(frozen=True)
class Qwen2AudioInput:
    """One audio's encoder input."""

    audio: AudioInput
    """The waveform (at most one window) and the log-mel it takes (padded to the window)."""
    num_frames: int
    """Log-mel frames that carry the audio (the rest of the window is padding the encoder ignores)."""


class Qwen2AudioPromptProcessor:
    """(prompt ids, decoded audios) -> (ids with each ``<|AUDIO|>`` expanded, one item per audio).

    Args:
        settings: the feature extractor's settings (``preprocessor_config.json``).
        audio_token_id: ``<|AUDIO|>``, the token of one audio embedding.
    """

    modality = "audio"
    """What ``process`` takes."""
    requires_item = False
    """Text-only prompts run on this model too."""

    def __init__(self, settings: AudioFeatureSettings, audio_token_id: int) -> None:
        self.settings = settings
        self.audio_token_id = audio_token_id
        self.log_mel = WhisperLogMel(settings.num_mel_bins, settings.sample_rate_hz, settings.n_fft,
                                     settings.hop_length, settings.chunk_length_s)
        self._settings_key = "qwen2-audio-" + settings.key()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path, num_mel_bins: int, audio_token_id: int
                        ) -> "Qwen2AudioPromptProcessor":
        return cls(AudioFeatureSettings.read(checkpoint_dir, num_mel_bins), audio_token_id)

    @property
    def sample_rate_hz(self) -> int:
        return self.settings.sample_rate_hz

    def num_frames(self, num_samples: int) -> int:
        """Frames of content of ``num_samples`` samples (the feature extractor's mask: one per hop started)."""
        return math.ceil(min(num_samples, self.log_mel.window_samples) / self.settings.hop_length)

    def num_embeds(self, num_samples: int) -> int:
        """``<|AUDIO|>`` tokens of an audio of ``num_samples`` samples."""
        return num_audio_embeds(self.num_frames(num_samples))

    def max_embeds_per_item(self) -> int:
        """Embeddings of a full window (750 for Qwen2-Audio's 30 s)."""
        return self.num_embeds(self.log_mel.window_samples)

    def process(self, token_ids: list[int], audios: list[DecodedAudio]) -> tuple[list[int], list[MultiModalItem]]:
        """Raises ValueError: an audio at another rate, longer than the window or too short, or the prompt's
        ``<|AUDIO|>`` runs do not match the audios."""
        inputs, lengths, identifiers = [], [], []
        window_s = self.settings.chunk_length_s
        for k, audio in enumerate(audios):
            where = f"audio {k + 1} of {len(audios)}" if len(audios) > 1 else "audio"
            if audio.sample_rate_hz != self.settings.sample_rate_hz:
                raise ValueError(f"{where}: decoded at {audio.sample_rate_hz} Hz, the model takes "
                                 f"{self.settings.sample_rate_hz} Hz.")
            num_samples = int(audio.samples.shape[0])
            if num_samples > self.log_mel.window_samples:
                raise ValueError(f"{where}: {audio.duration_s:.1f} s is longer than the model's {window_s} s "
                                 "window; send a shorter clip.")
            frames = self.num_frames(num_samples)
            if num_audio_embeds(frames) < 1:
                raise ValueError(f"{where}: {audio.duration_s * 1000:.0f} ms is too short for the model (it "
                                 "makes no audio embedding); send a longer clip.")
            samples = np.ascontiguousarray(audio.samples, dtype=np.float32)
            identifiers.append(hash_audio(samples, audio.sample_rate_hz, self._settings_key))
            lengths.append(num_audio_embeds(frames))
            inputs.append(Qwen2AudioInput(AudioInput(samples, self.log_mel, "audio"), frames))
        ids, offsets = expand_placeholders(token_ids, self.audio_token_id, lengths, what="audio")
        items = [MultiModalItem("audio", ident, off, n, data)
                 for ident, off, n, data in zip(identifiers, offsets, lengths, inputs)]
        return ids, items
