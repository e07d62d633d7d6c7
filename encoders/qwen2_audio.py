"""Qwen2-Audio's audio encoder, as transformers' ``Qwen2AudioEncoder`` (``last_hidden_state``) computes it
for the positions its processor keeps.

It is Whisper's encoder (``encoders.whisper.WhisperEncoderTower``: the same conv stem, positions, pre-norm
layers with packed q/k/v and a zero k bias, the same tensor names) with two differences:

- after the layers, an ``AvgPool1d(2, stride 2)`` over positions comes before the final ``layer_norm``;
- the features are a 30 s window of which only the first ``num_frames`` carry the audio; transformers
  masks the keys of the positions past ``(num_frames - 1) // 2 + 1`` (conv2's stride) in every layer and
  the processor keeps ``num_audio_embeds(num_frames)`` pooled rows.

Masked keys, per-position layers and a pooling of aligned pairs mean the kept rows depend only on the
unmasked positions: each item runs the conv stem over the whole window, then the layers over its
unmasked positions alone (no mask needed, no work spent on padding), then the pooling and the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoders.whisper import WhisperEncoderTower


def num_encoder_positions(num_frames: int) -> int:
    """Encoder positions that ``num_frames`` log-mel frames of audio cover (conv2's stride 2)."""
    return (num_frames - 1) // 2 + 1


def num_audio_embeds(num_frames: int) -> int:
    """Embeddings (``<|AUDIO|>`` tokens) of an audio whose features have ``num_frames`` frames of content:
    transformers' ``Qwen2AudioProcessor`` rule, conv stride 2 then average pooling by 2."""
    return max(0, (num_encoder_positions(num_frames) - 2) // 2 + 1)


class Qwen2AudioEncoderTower(WhisperEncoderTower):
    """Built from a transformers ``Qwen2AudioEncoderConfig``; loads ``Qwen2AudioEncoder.state_dict()``
    names (Whisper's). ``encode`` gives each item's pooled rows."""

    def encode(self, input_features: torch.Tensor, num_frames: list[int]) -> list[torch.Tensor]:
        """input_features [B, num_mel_bins, 2 * max_source_positions] (any float dtype), each item's
        frames of content ``num_frames`` [B] -> per item [num_audio_embeds(frames), d_model] in the
        parameters' dtype."""
        expected = (self.num_mel_bins, self.num_frames)
        if input_features.dim() != 3 or tuple(input_features.shape[1:]) != expected:
            raise ValueError(f"Qwen2AudioEncoderTower: input_features must be [B, {expected[0]}, {expected[1]}] "
                             f"(the window the feature extractor pads to), got {list(input_features.shape)}.")
        features = input_features.to(self.conv1.weight.dtype)
        features = F.gelu(self.conv2(F.gelu(self.conv1(features))))                # [B, d_model, positions]
        stem = features.transpose(1, 2) + self.embed_positions.weight               # [B, positions, d_model]
        out = []
        for b, frames in enumerate(num_frames):
            num_embeds = num_audio_embeds(frames)
            hidden = stem[b:b + 1, :num_encoder_positions(frames)].contiguous()      # [1, S, d_model]
            for layer in self.layers:
                hidden = layer(hidden)
            pooled = F.avg_pool1d(hidden.transpose(1, 2), kernel_size=2, stride=2)  # [1, d_model, S // 2]
            out.append(self.layer_norm(pooled.transpose(1, 2)[0, :num_embeds]))     # [num_embeds, d_model]
        return out
