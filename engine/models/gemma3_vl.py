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

Attention among image tokens, as transformers' processor path (``token_type_ids``,
``create_masks_for_vision_model``): the tokens of one image (a run of ``<image_soft_token>``) attend to each
other both ways, every other token causally; sliding layers apply their window on top (AND(window,
OR(causal, same image))). ``forward`` gives each image token the last position of its run as its key limit
(``AttentionMetadata.key_limit``, ``image_key_limits``); the model declares ``bidirectional_media``, so the
scheduler never ends a prefill chunk inside an image (vLLM's choice too): a chunk holds the rest of every
image it reaches, and the image tokens computed in an earlier chunk (or taken from the prefix cache) saw the
whole image already.

Logits: transformers' ``Gemma3ForConditionalGeneration`` applies no final-logit soft-capping (its
text-only ``Gemma3ForCausalLM`` does, from ``text_config.final_logit_softcapping``, None in every
released Gemma 3); this class follows the multimodal one and never soft-caps.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from encoders.siglip import SiglipVisionTower
from engine.distributed.group import TensorParallelGroup
from engine.forward_context import current_forward_context
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.interfaces import MediaWarmUp
from engine.models.llava import CHECKPOINT_PREFIXES
from engine.models.vision_language import VisionLanguageModel, image_token_id
from multimodal.gemma3_processing import Gemma3PromptProcessor
from multimodal.image_processor import ProcessedImage, load_image_processor


def image_key_limits(input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                     image_token_id: int) -> torch.Tensor:
    """The last key position each token of a step sees: an image token, the position of the last token of its
    run of image tokens in its request; any other token, its own. Device ops only (no host sync).

    input_ids, positions: [T] (T may include padding past query_start_loc[-1]); query_start_loc: [R + 1]
    int32 -> [T] int32.
    """
    num_tokens = input_ids.shape[0]
    idx = torch.arange(num_tokens, device=input_ids.device, dtype=query_start_loc.dtype)             # [T]
    req = torch.searchsorted(query_start_loc[1:].contiguous(), idx, right=True)                      # [T]
    is_img = input_ids == image_token_id                                                              # [T]
    same_run = torch.zeros_like(is_img)
    same_run[:-1] = is_img[:-1] & is_img[1:] & (req[:-1] == req[1:])     # the next token continues the run
    run_end = torch.where(same_run, num_tokens, idx.long())                                          # [T]
    run_end = run_end.flip(0).cummin(0).values.flip(0)           # the first run end at or after each token
    return torch.where(is_img, positions[run_end], positions).to(torch.int32)


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
    capabilities = replace(VisionLanguageModel.capabilities, bidirectional_media=True)

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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The language model's forward, each image's tokens attending to the whole image: on a step with a
        prefill chunk (eager, or a mixed CUDA graph: device ops only), the step's ``key_limit``
        (``image_key_limits``; on CPU only where the step holds an image token). A pure-decode step (and its
        CUDA graph) is causal."""
        ctx = current_forward_context()
        meta = ctx.attn_metadata if ctx is not None else None
        if meta is not None and meta.max_query_len > 1:
            if input_ids.is_cuda or bool((input_ids == self.image_token_id).any()):
                meta.key_limit = image_key_limits(input_ids, positions, meta.query_start_loc, self.image_token_id)
        return super().forward(input_ids, positions, inputs_embeds)

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

    def media_warm_up(self) -> list[MediaWarmUp]:
        """One image at the tower's size (every image is resized to it)."""
        side_px = self.config.vision_config.image_size
        image = ProcessedImage(torch.zeros(3, side_px, side_px), None)
        return [MediaWarmUp.at_placeholders("image", image, self.num_image_embeds, self.image_token_id)]

    def embed_multimodal(self, modality: str, items: list[ProcessedImage]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, text hidden] per image."""
        if modality != "image":
            raise ValueError(f"Gemma 3 takes images, not {modality}.")
        param = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.stack([it.pixel_values for it in items]).to(param.device, param.dtype)   # [N, 3, H, W]
        (last,) = self.vision_tower(pixels, [-1])                                                 # [N, P*P, C]
        features = self.multi_modal_projector(self.vision_tower.post_layernorm(last))
        return list(features.unbind(0))
