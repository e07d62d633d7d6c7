"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, Gemma 3's
multimodal projector and the text model ``engine.models.gemma3.Gemma3ForCausalLM``, as transformers'
``modeling_gemma3``.

- tower: ``SiglipVisionModel``'s ``last_hidden_state`` (every layer, then ``post_layernorm``);
- projector (``Gemma3MultiModalProjector``): the patches as a [C, P, P] grid, ``AvgPool2d`` down to
  ``mm_tokens_per_image`` tokens, ``mm_soft_emb_norm`` (Gemma's RMSNorm, x * (1 + w), in float32) and a
  matmul by ``mm_input_projection_weight`` [vision hidden, text hidden];
- prompt: each ``<start_of_image>`` becomes ``\\n\\n <start_of_image> <image_soft_token> x N
  <end_of_image> \\n\\n`` (``multimodal.gemma3_processing``); the image embeddings replace the
  ``<image_soft_token>`` embeddings unscaled, the text embeddings are scaled by sqrt(hidden) as Gemma's.

Attention among image tokens: transformers, given ``token_type_ids`` (its processor returns them, and
``generate`` passes them on the prefill), lets the tokens of one image attend to each other
bidirectionally (``create_masks_for_vision_model``). Chorus' paged attention is causal only, so this
model computes every token causally: it equals transformers called without ``token_type_ids`` (the causal
mask) exactly, and differs from transformers' default processor path (bidirectional within an image).
Text-only prompts are exact either way.

Logits: transformers' ``Gemma3ForConditionalGeneration`` applies no final-logit soft-capping (its
text-only ``Gemma3ForCausalLM`` does, from ``text_config.final_logit_softcapping``, None in every
released Gemma 3); this class follows the multimodal one and never soft-caps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from encoders.siglip import SiglipVisionTower
from engine.distributed.group import TensorParallelGroup
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llava import CHECKPOINT_PREFIXES
from engine.models.vision_language import VisionLanguageModel, image_token_id
from multimodal.gemma3_processing import Gemma3PromptProcessor
from multimodal.image_processor import ProcessedImage, load_image_processor

logger = logging.getLogger("chorus.models")


class Gemma3MultiModalProjector(nn.Module):
    """[N, P*P, C] patch features -> [N, mm_tokens_per_image, text hidden]."""

    def __init__(self, config) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(vision.hidden_size), requires_grad=False)
        self.eps = vision.layer_norm_eps
        self.patches_per_side = vision.image_size // vision.patch_size
        self.tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if self.tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side "
                             f"divides the {self.patches_per_side} patches per side")
        self.kernel = self.patches_per_side // self.tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, c = features.shape
        grid = features.transpose(1, 2).reshape(n, c, self.patches_per_side, self.patches_per_side).contiguous()
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (x * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(x, self.mm_input_projection_weight).type_as(features)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """SigLIP tower + Gemma 3 projector + ``Gemma3ForCausalLM`` (``language_model``). Checkpoints of both
    transformers layouts load (``model.language_model.*`` / ``language_model.model.*``)."""

    checkpoint_prefixes = CHECKPOINT_PREFIXES
    weight_parts = ("vision_tower", "multi_modal_projector", "language_model")

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.config = config
        vision_config, text_config = config.vision_config, config.text_config
        if vision_config.model_type != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {vision_config.model_type!r} vision tower is not supported "
                             "(SigLIP only).")
        self.vision_tower = SiglipVisionTower(vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = Gemma3ForCausalLM(text_config, max_position, tp=tp)
        # transformers' Gemma3ForConditionalGeneration (5.24) never soft-caps its logits (only the text-only
        # Gemma3ForCausalLM reads final_logit_softcapping); released Gemma 3 configs set it to None anyway.
        self.language_model.final_logit_softcapping = None
        self.image_token_id = image_token_id(config)
        self.boi_token_id, self.eoi_token_id = (
            int(next(v for v in (getattr(config, f"{k}_token_id", None), getattr(config, f"{k}_token_index", None))
                     if v is not None)) for k in ("boi", "eoi"))
        self.num_image_embeds = int(config.mm_tokens_per_image)
        self.vocab_size = text_config.vocab_size
        logger.warning("Gemma 3 with images: image tokens attend causally (Chorus' attention is causal only); "
                       "transformers' processor path attends bidirectionally within an image, so outputs "
                       "with images can differ from it (text-only prompts are exact).")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gemma's scaled token embeddings (an image token outside the vocabulary embeds as token 0, as
        transformers; the engine overwrites those rows with the image embeddings)."""
        if self.image_token_id >= self.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return self.language_model.embed_input_ids(input_ids)

    def make_prompt_processor(self, checkpoint_dir: Path) -> Gemma3PromptProcessor:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(checkpoint_dir))
        newline_ids = tok.encode("\n\n", add_special_tokens=False)
        return Gemma3PromptProcessor(load_image_processor(checkpoint_dir), self.image_token_id, self.boi_token_id,
                                     self.eoi_token_id, newline_ids, self.num_image_embeds)

    def embed_multimodal(self, modality: str, items: list[ProcessedImage]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, text hidden] per image."""
        if modality != "image":
            raise ValueError(f"Gemma 3 takes images, not {modality}.")
        param = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.stack([it.pixel_values for it in items]).to(param.device, param.dtype)   # [N, 3, H, W]
        (last,) = self.vision_tower(pixels, [-1])                                                 # [N, P*P, C]
        features = self.multi_modal_projector(self.vision_tower.post_layernorm(last))
        return list(features.unbind(0))
