"""The CLIP ViT vision tower (LLaVA-1.5's image encoder), exact against transformers' CLIPVisionModel.

Embeddings (class token + patches + learned positions) -> pre_layrnorm -> pre-norm encoder layers.
``forward`` returns the hidden states that LLaVA picks (``vision_feature_layer``), indexed like
``CLIPVisionModel(output_hidden_states=True).hidden_states`` (0 = the embeddings after pre_layrnorm);
the pooled head (post_layernorm on the class token) is never built and its tensors are skipped.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from encoders.vit import ViTTower


class CLIPVisionTower(ViTTower):
    """CLIP vision transformer built from a transformers ``CLIPVisionConfig``, with only the first
    ``num_layers`` encoder layers (default all): LLaVA reads layer -2, so it never needs the last.

    ``forward(pixel_values [N, 3, image_size, image_size], feature_layers)`` -> one
    [N, 1 + patches, hidden] per requested layer; ``load_weights`` takes
    ``CLIPVisionModel.state_dict()`` names.
    """

    name = "CLIPVisionTower"
    expected_names = "transformers' CLIPVisionModel.state_dict()"

    def __init__(self, config, num_layers: Optional[int] = None) -> None:
        super().__init__(config, num_layers, class_token=True, patch_bias=False)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, H, W] -> hidden state 0 [N, 1 + patches, hidden] (after pre_layrnorm)."""
        return self.pre_layrnorm(self.embeddings(pixel_values))

    def skipped_prefixes(self) -> tuple[str, ...]:
        return ("post_layernorm.",)
