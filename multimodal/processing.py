"""Prompt-side multimodal processing: each image of a prompt becomes a run of placeholder tokens
(one per encoder embedding) and a ``MultiModalItem`` the engine turns into a scheduled feature.

A model family's processor says how many embeddings an image yields and which token stands for
them; ``expand_placeholders`` then rewrites the prompt's token ids the way transformers'
processors rewrite the text (``<image>`` -> ``<image>`` x N): a single placeholder token per
image is expanded, a run that already has the right length is kept (a pre-expanded prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from PIL import Image

from multimodal.hashing import hash_image
from multimodal.image_processor import ImageProcessor, ProcessedImage, Qwen2VLImageProcessor


@dataclass
class MultiModalItem:
    """One processed media item of a prompt, placed."""

    modality: str
    """'image' or 'audio'."""
    identifier: str
    """Content hash over the content and every processor setting (the encoder-cache key)."""
    offset: Optional[int]
    """Index of the item's first placeholder token in the expanded prompt; None for an encoder-decoder
    input the decoder reads through cross-attention (Whisper's audio)."""
    length: int
    """Encoder embeddings of the item (= its placeholder tokens when it has an offset)."""
    data: Any
    """The encoder's inputs (``ProcessedImage``, or a log-mel tensor)."""


class ImagePromptProcessor:
    """Base: turns (prompt token ids, images) into (expanded ids, items).

    Args:
        image_processor: pixels -> encoder inputs (``multimodal.image_processor``).
        image_token_id: the token that stands for one image embedding in the prompt.
    """

    modality = "image"
    """What ``process`` takes."""

    def __init__(self, image_processor: ImageProcessor, image_token_id: int) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id

    def num_embeds(self, processed: ProcessedImage) -> int:
        """Encoder embeddings (placeholder tokens) of one processed image."""
        raise NotImplementedError

    def max_embeds_per_item(self) -> int:
        """Embeddings of the largest image this model can produce (sizes the encoder budget)."""
        raise NotImplementedError

    def process(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[MultiModalItem]]:
        processed = [self.image_processor(img) for img in images]
        settings = self.image_processor.settings_key()
        identifiers = [hash_image(img, settings) for img in images]
        lengths = [self.num_embeds(p) for p in processed]
        ids, offsets = expand_placeholders(token_ids, self.image_token_id, lengths)
        items = [MultiModalItem("image", ident, off, n, p)
                 for ident, off, n, p in zip(identifiers, offsets, lengths, processed)]
        return ids, items


class LlavaPromptProcessor(ImagePromptProcessor):
    """LLaVA-1.5: a fixed number of embeddings per image (the tower's patches, plus its CLS token
    under the 'full' feature strategy)."""

    def __init__(self, image_processor: ImageProcessor, image_token_id: int, num_image_embeds: int) -> None:
        super().__init__(image_processor, image_token_id)
        self.num_image_embeds = num_image_embeds

    def num_embeds(self, processed: ProcessedImage) -> int:
        return self.num_image_embeds

    def max_embeds_per_item(self) -> int:
        return self.num_image_embeds


class Qwen2VLPromptProcessor(ImagePromptProcessor):
    """Qwen2-VL: the image's size decides its embeddings (t * h * w patches / merge_size**2)."""

    def __init__(self, image_processor: Qwen2VLImageProcessor, image_token_id: int) -> None:
        super().__init__(image_processor, image_token_id)

    def num_embeds(self, processed: ProcessedImage) -> int:
        t, h, w = processed.grid_thw
        return t * h * w // self.image_processor.merge_size ** 2

    def max_embeds_per_item(self) -> int:
        patch = self.image_processor.patch_size
        max_patches = self.image_processor.max_pixels // (patch * patch)
        return max_patches // self.image_processor.merge_size ** 2


def expand_placeholders(token_ids: list[int], placeholder_id: int,
                        lengths: list[int], what: str = "image") -> tuple[list[int], list[int]]:
    """Expand the prompt's placeholder runs to ``lengths`` (one run per item, in order); ``what`` names the
    items in errors ("image", "audio").

    Returns:
        (expanded token ids, offset of each item's first placeholder token).

    Raises:
        ValueError: the prompt's runs and the items do not match (count, or a run whose length is
            neither 1 nor the item's).
    """
    runs: list[tuple[int, int]] = []   # (start, length) of each run of placeholder tokens
    i = 0
    while i < len(token_ids):
        if token_ids[i] == placeholder_id:
            j = i
            while j < len(token_ids) and token_ids[j] == placeholder_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    runs = _split_runs(runs, lengths, what)
    if len(runs) != len(lengths):
        raise ValueError(f"prompt: it has {len(runs)} {what} placeholder(s) but {len(lengths)} {what}(s) were "
                         f"given; put one {what} placeholder in the prompt per {what} (chat messages do this "
                         "for you).")
    out: list[int] = []
    offsets: list[int] = []
    prev = 0
    for (start, run_len), n in zip(runs, lengths):
        out.extend(token_ids[prev:start])
        offsets.append(len(out))
        out.extend([placeholder_id] * n)
        prev = start + run_len
    out.extend(token_ids[prev:])
    return out, offsets


def _split_runs(runs: list[tuple[int, int]], lengths: list[int], what: str = "image") -> list[tuple[int, int]]:
    """Runs as items: a run of 1 is one item; a longer run is either pre-expanded items back to back
    (each exactly its item's length) or, failing that, one item per token (``<image><image>``: two
    images next to each other, as a chat template renders two adjacent image parts)."""
    out: list[tuple[int, int]] = []
    k = 0
    for start, run_len in runs:
        if run_len == 1 or k >= len(lengths):
            out.append((start, run_len))
            k += 1
            continue
        first, pos, left = k, start, run_len
        while left > 0 and k < len(lengths) and lengths[k] <= left:
            out.append((pos, lengths[k]))
            pos += lengths[k]
            left -= lengths[k]
            k += 1
        if not left:
            continue
        if first + run_len > len(lengths):
            raise ValueError(f"prompt: a run of {run_len} {what} placeholder tokens at token {start} does not "
                             f"match the {what}s' sizes; use one placeholder token per {what}.")
        del out[len(out) - (k - first):]
        out.extend((start + i, 1) for i in range(run_len))
        k = first + run_len
    return out

