"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP or SigLIP vision tower, a 2-layer projector and
any language model Chorus runs (Llama, Mistral, Qwen2).

The engine calls ``embed_multimodal`` for the images a step must encode (their outputs go into the
encoder cache by content hash), merges the cached embeddings at the placeholder tokens of the
step's ``inputs_embeds``, and runs the language model over them like any prompt. Checkpoints of
both transformers layouts load: 4.x (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``) and 5.x (``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``lm_head.*``).

LoRA: the language model's projections, and, with ``--enable-tower-connector-lora``, the tower's and the
projector's (``encoder_lora_parts``: their ``lora_slices``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from encoders.clip import CLIPVisionTower
from encoders.siglip import SiglipVisionTower
from encoders.vit import ACTIVATIONS, LoRASlices, TowerWeights
from engine.layers.linear import Linear
from engine.distributed.group import TensorParallelGroup
from engine.models.interfaces import MediaWarmUp
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.models.vision_language import VisionLanguageModel, image_token_id
from multimodal.image_processor import ProcessedImage, load_image_processor
from multimodal.processing import LlavaPromptProcessor

_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
}
_TOWERS = {"clip_vision_model": CLIPVisionTower, "siglip_vision_model": SiglipVisionTower}

# Checkpoint (and PEFT module) name prefix -> ours, transformers 5.x first.
CHECKPOINT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("language_model.", "language_model."),
    ("vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def language_model_class(text_config) -> type[LlamaForCausalLM]:
    model_type = getattr(text_config, "model_type", "")
    if model_type not in _LANGUAGE_MODELS:
        raise ValueError(f"LLaVA with a {model_type!r} language model is not supported; supported: "
                         f"{', '.join(sorted(_LANGUAGE_MODELS))}.")
    return _LANGUAGE_MODELS[model_type]


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2, from the tower's (concatenated) features to the LM's width."""

    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act={act!r} is not supported; use one of {sorted(ACTIVATIONS)}.")
        self.linear_1 = Linear(in_features, [hidden_size], bias=bias)
        self.act = ACTIVATIONS[act]
        self.linear_2 = Linear(hidden_size, [hidden_size], bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, S, in_features] -> [N, S, hidden]."""
        return self.linear_2(self.act(self.linear_1(features)))

    def lora_slices(self) -> LoRASlices:
        """Both projections take adapters (transformers' names are ours)."""
        return {"linear_1": ("linear_1", 0), "linear_2": ("linear_2", 0)}

    def load_weights(self, weights) -> None:
        """``multi_modal_projector.*`` tensors (prefix stripped) by their transformers names."""
        loader = TowerWeights(self, "LlavaProjector", "transformers' LlavaMultiModalProjector.state_dict()",
                              outer_prefixes="'multi_modal_projector.'")
        for name, tensor in weights:
            loader.load(name, name, tensor)
        loader.finish()


class LlavaForConditionalGeneration(VisionLanguageModel):
    """Vision tower + projector + a paged-KV language model (``language_model``)."""

    checkpoint_prefixes = CHECKPOINT_PREFIXES
    weight_parts = ("vision_tower", "multi_modal_projector", "language_model")
    encoder_lora_parts = ("vision_tower", "multi_modal_projector")

    def __init__(self, config, max_position: int, tp: Optional[TensorParallelGroup] = None) -> None:
        super().__init__()
        self.config = config
        vision_config, text_config = config.vision_config, config.text_config
        layer = config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.select_strategy!r} is not supported; "
                             "LLaVA uses 'default' (drop the first token) or 'full'.")
        tower_cls = _TOWERS.get(vision_config.model_type)
        if tower_cls is None:
            raise ValueError(f"LLaVA with a {vision_config.model_type!r} vision tower is not supported; "
                             f"supported: {', '.join(sorted(_TOWERS))}.")
        num_full = vision_config.num_hidden_layers
        deepest = max(i if i >= 0 else num_full + 1 + i for i in self.feature_layers)
        self.vision_tower = tower_cls(vision_config, num_layers=max(deepest, 1))
        self.multi_modal_projector = LlavaProjector(
            vision_config.hidden_size * len(self.feature_layers), text_config.hidden_size,
            config.projector_hidden_act, bool(getattr(config, "multimodal_projector_bias", True)))
        self.language_model = language_model_class(text_config)(text_config, max_position, tp=tp)
        self.image_token_id = image_token_id(config)
        patches = (vision_config.image_size // vision_config.patch_size) ** 2
        has_cls = tower_cls is CLIPVisionTower
        self.num_image_embeds = patches + int(has_cls) - int(self.select_strategy == "default")
        """Embeddings (placeholder tokens) per image."""

    # ------------------------------------------------------------------ multimodal
    def make_prompt_processor(self, checkpoint_dir: Path) -> LlavaPromptProcessor:
        """The prompt side of this model (the checkpoint's image processor): one image ->
        ``num_image_embeds`` placeholder tokens."""
        return LlavaPromptProcessor(load_image_processor(checkpoint_dir), self.image_token_id,
                                    self.num_image_embeds)

    def media_warm_up(self) -> list[MediaWarmUp]:
        """One image at the tower's size (every image is resized to it)."""
        side_px = self.config.vision_config.image_size
        image = ProcessedImage(torch.zeros(3, side_px, side_px), None)
        return [MediaWarmUp.at_placeholders("image", image, self.num_image_embeds, self.image_token_id)]

    def embed_multimodal(self, modality: str, items: list[ProcessedImage]) -> list[torch.Tensor]:
        """The images' embeddings in the LM's space: one [num_image_embeds, hidden] per item."""
        if modality != "image":
            raise ValueError(f"LLaVA takes images, not {modality}.")
        param = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([it.pixel_values for it in items]).to(param.device, param.dtype)  # [N, 3, H, W]
        hidden = self.vision_tower(pixels, self.feature_layers)                            # each [N, S, C]
        if self.select_strategy == "default":
            hidden = [h[:, 1:] for h in hidden]
        features = self.multi_modal_projector(torch.cat(hidden, dim=-1))                    # [N, S', hidden]
        return list(features.unbind(0))
