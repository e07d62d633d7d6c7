"""Qwen2-Audio's audio encoder, as transformers' ``Qwen2AudioEncoder`` (``last_hidden_state``) computes it
for the positions its processor keeps.

It is Whisper's encoder (``encoders.whisper.WhisperEncoderTower``: the same conv stem, positions, pre-norm
layers with packed q/k/v and a zero k bias, the same tensor names) with two differences:

- after the layers, an ``AvgPool1d(2, stride 2)`` over positions comes before the final ``layer_norm``;
- the features are a 30 s window of which only the first ``num_frames`` carry the audio; transformers
  masks the keys of the positions past ``(num_frames - 1) // 2 + 1`` (conv2's stride) in every layer and
  the processor keeps ``num_audio_embeds(num_frames)`` pooled rows.

Masked keys, per-position layers and a pooling of aligned pairs mean the kept rows depend only on the
unmasked positions: the conv stem runs over the whole windows, then the layers run once over every
item's unmasked positions packed end to end (no mask, no work spent on padding; attention within each
item, ``encoders.varlen_attention``), then each item's pooling and the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoders.varlen_attention import join_runs, packed_segments
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
        lengths = [num_encoder_positions(frames) for frames in num_frames]
        hidden = torch.cat([stem[b, :length] for b, length in enumerate(lengths)])  # [sum(lengths), d_model]
        segments = packed_segments(join_runs((1, length) for length in lengths), hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, segments)
        out = []
        for item, frames in zip(hidden.split(lengths), num_frames):              # each [S_i, d_model]
            pooled = F.avg_pool1d(item.t()[None], kernel_size=2, stride=2)[0]    # [d_model, S_i // 2]
            out.append(self.layer_norm(pooled.t()[:num_audio_embeds(frames)]))   # [num_embeds, d_model]
        return out
