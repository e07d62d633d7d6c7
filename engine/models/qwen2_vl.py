"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``),
images: a dynamic-resolution vision tower (the image's size decides its embeddings), and a Qwen2
language model with M-RoPE (3-D positions).

Positions: text tokens advance one position each on all three rows; an image's tokens take
(t, h, w) grid positions starting at the position after the text before it, and the text after
it continues from that start + max(h, w) / merge_size. ``mrope_positions`` computes the prompt's
[3, P] table once per request (the runner keeps it); a token past the prompt is at its index +
the request's delta. Weights load from both transformers layouts: 5.x (``model.language_model.*``,
``model.visual.*``, ``lm_head.*``) and 4.x (``model.*``, ``visual.*``, ``lm_head.*``).

LoRA: the language model's projections, and, with ``--enable-tower-connector-lora``, the vision tower's
and its merger's (``encoder_lora_parts``: the tower's ``lora_slices``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from encoders.qwen2_5_vl import Qwen2_5_VLVisionTransformer
from encoders.qwen2_vl import Qwen2VLVisionTransformer, patch_shape
from engine.distributed.group import TensorParallelGroup
from engine.layers.rotary import MRotaryEmbedding
from engine.models.interfaces import MediaWarmUp, ModelCapabilities
from engine.models.llama import Qwen2ForCausalLM
from engine.models.vision_language import VisionLanguageModel, image_token_id
from engine.request import MultiModalFeature
from multimodal.image_processor import ProcessedImage, Qwen2VLImageProcessor, load_image_processor
from multimodal.processing import Qwen2VLPromptProcessor

CHECKPOINT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("visual.", "visual."),
    ("model.", "language_model.model."),
    ("language_model.", "language_model."),
)


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    """Qwen2 with M-RoPE."""

    rotary_cls = MRotaryEmbedding


def mrope_positions(num_prompt_tokens: int, placeholders: list[tuple[int, int, tuple[int, int, int]]],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """The prompt's M-RoPE positions, as transformers' ``get_rope_index`` computes them.

    Args:
        num_prompt_tokens: P.
        placeholders: (offset, length, grid (t, h, w) in patches) of each image, in prompt order.
        merge_size: the tower's spatial_merge_size.

    Returns:
        (positions [3, P] int64, delta): a token at index i >= P is at position i + delta on all rows.
    """
    out = np.empty((3, num_prompt_tokens), dtype=np.int64)
    current = 0   # next text position
    prev_end = 0  # prompt index after the previous image
    for offset, length, (t, h, w) in sorted(placeholders):
        text_len = offset - prev_end
        out[:, prev_end:offset] = np.arange(current, current + text_len)
        current += text_len
        gh, gw = h // merge_size, w // merge_size
        if t * gh * gw != length:
            raise ValueError(f"an image of grid {(t, h, w)} has {t * gh * gw} tokens, its placeholder {length}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, offset:offset + length] = tt.reshape(-1) + current
        out[1, offset:offset + length] = hh.reshape(-1) + current
        out[2, offset:offset + length] = ww.reshape(-1) + current
        current += max(gh, gw)
        prev_end = offset + length
    out[:, prev_end:] = np.arange(current, current + num_prompt_tokens - prev_end)
    delta = int(out.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
    return out, delta


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Vision transformer (with its patch merger) + Qwen2 with M-RoPE over a paged KV cache.
    Its forward takes positions [T] (text-only steps) or [3, T] (steps with image tokens)."""

    checkpoint_prefixes = CHECKPOINT_PREFIXES
    weight_parts = ("visual", "language_model")
    encoder_lora_parts = ("visual",)
    capabilities = ModelCapabilities(multimodal=True, mrope=True, tensor_parallel=True, weight_quantization=True)
    vision_cls: type[torch.nn.Module] = Qwen2VLVisionTransformer

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.config = config
        text_config = config.get_text_config()
        self.visual = self.vision_cls(config.vision_config)
        self.language_model = Qwen2VLTextForCausalLM(text_config, max_position, tp=tp)
        self.image_token_id = image_token_id(config)
        self.merge_size = config.vision_config.spatial_merge_size

    # ------------------------------------------------------------------ multimodal
    def make_prompt_processor(self, checkpoint_dir: Path) -> Qwen2VLPromptProcessor:
        """The prompt side of this model (the checkpoint's image processor): an image's size decides its
        placeholder tokens."""
        image_processor = load_image_processor(checkpoint_dir)
        if not isinstance(image_processor, Qwen2VLImageProcessor):
            raise ValueError(f"Qwen2-VL needs a Qwen2VLImageProcessor (preprocessor_config.json), got "
                             f"{type(image_processor).__name__}.")
        if image_processor.merge_size != self.merge_size:
            raise ValueError(f"preprocessor_config.json merge_size={image_processor.merge_size} differs from the "
                             f"vision config's spatial_merge_size={self.merge_size}.")
        return Qwen2VLPromptProcessor(image_processor, self.image_token_id)

    def media_warm_up(self) -> list[MediaWarmUp]:
        """Two image sizes (the image's size decides the tower's work): 32 x 32 and 16 x 24 patches at merge
        size 2 (448 x 448 and 224 x 336 pixels at 14-pixel patches), in units of the merge size elsewhere."""
        vision = self.config.vision_config
        patch_len = math.prod(patch_shape(vision))
        items = []
        for rows, cols in ((16, 16), (8, 12)):
            grid = (1, rows * self.merge_size, cols * self.merge_size)
            image = ProcessedImage(torch.zeros(math.prod(grid), patch_len), grid)   # [t * h * w, C*T*P*P]
            items.append(MediaWarmUp.at_placeholders("image", image, rows * cols, self.image_token_id))
        return items

    def embed_multimodal(self, modality: str, items: list[ProcessedImage]) -> list[torch.Tensor]:
        """One [t * h * w / merge_size**2, hidden] per image, through one tower call."""
        if modality != "image":
            raise ValueError(f"Qwen2-VL takes images here, not {modality}.")
        device = self.visual.patch_embed.weight.device
        pixels = torch.cat([it.pixel_values for it in items]).to(device)          # [sum patches, C*T*P*P]
        grid = torch.tensor([it.grid_thw for it in items], dtype=torch.int64)     # [N, 3]
        embeds = self.visual(pixels, grid)                                         # [sum tokens, hidden]
        sizes = [t * h * w // self.merge_size ** 2 for t, h, w in grid.tolist()]
        return list(embeds.split(sizes))

    def mrope_positions(self, num_prompt_tokens: int,
                        features: list[MultiModalFeature]) -> tuple[np.ndarray, int]:
        """[3, P] prompt positions and the delta after it, for a request's image features."""
        placeholders = [(f.placeholder.offset, f.placeholder.length, tuple(f.data.grid_thw)) for f in features]
        return mrope_positions(num_prompt_tokens, placeholders, self.merge_size)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL, images: Qwen2-VL's language model, positions and processor with a window-attention
    vision tower (RMSNorm, gated MLP)."""

    vision_cls = Qwen2_5_VLVisionTransformer
