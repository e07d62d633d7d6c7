"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): a Whisper-style audio encoder, average pooling, a
linear projector and a Qwen2 language model, as transformers' ``modeling_qwen2_audio``.

- encoder (``encoders.qwen2_audio.Qwen2AudioEncoderTower``): the log-mel of the audio padded to the 30 s
  window, conv stem, layers over the positions that carry audio, ``AvgPool1d(2)``, ``layer_norm``;
- projector (``multi_modal_projector.linear``): d_model -> the language model's hidden size, with bias;
- prompt: each ``<|AUDIO|>`` is expanded to the audio's embeddings (``multimodal.qwen2_audio_processing``),
  whose token embeddings the projected audio rows replace.

Audio goes through the engine as images do: encoded once per content hash into the encoder cache, within
the scheduler's encoder budget, its rows merged at the placeholder tokens of each step (chunked prefill may
split an audio's run; the prefix cache keys blocks by the audio's hash). Checkpoints of both transformers
layouts load (5.x ``model.audio_tower.*`` / ``model.language_model.*`` / ``lm_head.*``; 4.x
``audio_tower.*`` / ``language_model.model.*`` / ``language_model.lm_head.*``).

Tensor parallelism shards the language model; the encoder and projector are whole on every rank, as a vision
tower is (``VisionLanguageModel``). LoRA adapters apply to the language model; an adapter with audio-tower
weights is refused as one for another model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from encoders.qwen2_audio import Qwen2AudioEncoderTower
from engine.distributed.group import TensorParallelGroup
from engine.models.interfaces import MediaWarmUp
from engine.models.llama import Qwen2ForCausalLM
from engine.models.vision_language import VisionLanguageModel
from multimodal.audio_processing import AudioFeatureSettings, AudioInput
from multimodal.qwen2_audio_processing import Qwen2AudioInput, Qwen2AudioPromptProcessor

# Checkpoint (and PEFT module) name prefix -> ours, transformers 5.x first.
CHECKPOINT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("language_model.", "language_model."),
    ("audio_tower.", "audio_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


class Qwen2AudioProjector(nn.Module):
    """[N, d_model] encoder rows -> [N, text hidden]."""

    def __init__(self, d_model: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_model, hidden_size, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)


class Qwen2AudioForConditionalGeneration(VisionLanguageModel):
    """Audio encoder + projector + ``Qwen2ForCausalLM`` (``language_model``); takes ``audio`` items."""

    checkpoint_prefixes = CHECKPOINT_PREFIXES
    weight_parts = ("audio_tower", "multi_modal_projector", "language_model")

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.config = config
        audio_config, text_config = config.audio_config, config.text_config
        if getattr(text_config, "model_type", "") != "qwen2":
            raise ValueError(f"Qwen2-Audio with a {text_config.model_type!r} language model is not supported "
                             "(qwen2 only).")
        self.audio_tower = Qwen2AudioEncoderTower(audio_config)
        self.multi_modal_projector = Qwen2AudioProjector(audio_config.d_model, text_config.hidden_size)
        self.language_model = Qwen2ForCausalLM(text_config, max_position, tp=tp)
        self.audio_token_id = int(config.audio_token_index)
        """``<|AUDIO|>``, the placeholder of one audio embedding."""
        self.vocab_size = text_config.vocab_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; an ``<|AUDIO|>`` id outside the vocabulary embeds as token 0 (the
        engine overwrites those rows with the audio's)."""
        if self.audio_token_id >= self.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.audio_token_id, 0)
        return self.language_model.model.embed_tokens(input_ids)

    def make_prompt_processor(self, checkpoint_dir: Path) -> Qwen2AudioPromptProcessor:
        """The checkpoint's feature extractor settings (``preprocessor_config.json``) and ``<|AUDIO|>``."""
        return Qwen2AudioPromptProcessor.from_checkpoint(checkpoint_dir, self.config.audio_config.num_mel_bins,
                                                         self.audio_token_id)

    def media_warm_up(self) -> list[MediaWarmUp]:
        """One full window of silence (Whisper's default feature settings with the model's mel bins)."""
        processor = Qwen2AudioPromptProcessor(AudioFeatureSettings(num_mel_bins=self.config.audio_config.num_mel_bins),
                                              self.audio_token_id)
        window = processor.log_mel.window_samples
        audio = Qwen2AudioInput(AudioInput(np.zeros(window, dtype=np.float32), processor.log_mel, "audio"),
                                processor.num_frames(window))
        return [MediaWarmUp.at_placeholders("audio", audio, processor.num_embeds(window), self.audio_token_id)]

    def embed_multimodal(self, modality: str, items: list[Qwen2AudioInput]) -> list[torch.Tensor]:
        """One [num_audio_embeds, text hidden] per audio (one batched log-mel, the layers per item)."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio takes audio, not {modality}.")
        param = self.multi_modal_projector.linear.weight
        features = AudioInput.features([it.audio for it in items], param.device)   # [N, mel, frames] float32
        rows = self.audio_tower.encode(features, [it.num_frames for it in items])  # each [n_i, d_model]
        return [self.multi_modal_projector(r) for r in rows]
