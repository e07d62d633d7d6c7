"""The SigLIP vision tower (LLaVA variants with a SigLIP encoder), exact against transformers'
SiglipVisionModel.

Embeddings (patches through a biased conv + learned positions, no class token) -> pre-norm encoder
layers. ``forward`` returns the hidden states indexed like
``SiglipVisionModel(output_hidden_states=True).hidden_states`` (no post-layernorm on them). When every
layer is built, ``post_layernorm`` is built and loaded too (None when the checkpoint lacks it):
``tower.post_layernorm`` of the last layer's features is SiglipVisionModel's ``last_hidden_state``.
The attention-pooling head is never built and its tensors are skipped.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from encoders.vit import ViTTower


class SiglipVisionTower(ViTTower):
    """SigLIP vision transformer built from a transformers ``SiglipVisionConfig``, with only the first
    ``num_layers`` encoder layers (default all).

    ``forward(pixel_values [N, 3, image_size, image_size], feature_layers)`` -> one [N, patches, hidden]
    per requested layer; ``load_weights`` takes ``SiglipVisionModel.state_dict()`` names.
    """

    name = "SiglipVisionTower"
    expected_names = "transformers' SiglipVisionModel.state_dict()"

    def __init__(self, config, num_layers: Optional[int] = None) -> None:
        super().__init__(config, num_layers, class_token=False, patch_bias=True)
        self.post_layernorm: Optional[nn.LayerNorm] = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if self.num_layers == config.num_hidden_layers else None)

    def skipped_prefixes(self) -> tuple[str, ...]:
        return ("head.",) if self.post_layernorm is not None else ("head.", "post_layernorm.")

    def optional_modules(self) -> tuple[str, ...]:
        return ("post_layernorm",) if self.post_layernorm is not None else ()
