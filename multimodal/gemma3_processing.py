"""Gemma 3 (``Gemma3ForConditionalGeneration``) prompt side: each ``<start_of_image>`` of the prompt (what
Gemma 3's chat template renders for an image) becomes, as transformers' ``Gemma3Processor`` rewrites it,
``"\\n\\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\\n\\n"`` (spliced
as token ids; the "\\n\\n" ids are the tokenizer's encoding of "\\n\\n"). A prompt that already holds the
image tokens (one per image or pre-expanded runs) is expanded as LLaVA's."""

from __future__ import annotations

from PIL import Image

from multimodal.image_processor import ImageProcessor, ProcessedImage
from multimodal.processing import ImagePromptProcessor, MultiModalItem


class Gemma3PromptProcessor(ImagePromptProcessor):
    """A fixed ``mm_tokens_per_image`` embeddings per image (no pan-and-scan crops)."""

    def __init__(self, image_processor: ImageProcessor, image_token_id: int, boi_token_id: int,
                 eoi_token_id: int, newline_ids: list[int], num_image_embeds: int) -> None:
        super().__init__(image_processor, image_token_id)
        self.boi_token_id, self.eoi_token_id = boi_token_id, eoi_token_id
        self.newline_ids = list(newline_ids)
        self.num_image_embeds = num_image_embeds

    def num_embeds(self, processed: ProcessedImage) -> int:
        return self.num_image_embeds

    def max_embeds_per_item(self) -> int:
        return self.num_image_embeds

    def expand_boi(self, token_ids: list[int]) -> list[int]:
        """Each ``<start_of_image>`` not already followed by an image token -> the full image sequence
        with one image token (``expand_placeholders`` then makes it ``num_image_embeds``)."""
        out: list[int] = []
        for i, tok in enumerate(token_ids):
            nxt = token_ids[i + 1] if i + 1 < len(token_ids) else None
            if tok == self.boi_token_id and nxt != self.image_token_id:
                out.extend(self.newline_ids + [self.boi_token_id, self.image_token_id, self.eoi_token_id]
                           + self.newline_ids)
            else:
                out.append(tok)
        return out

    def process(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[MultiModalItem]]:
        return super().process(self.expand_boi(token_ids), images)
