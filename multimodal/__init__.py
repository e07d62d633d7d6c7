"""Chorus media loading, processing and encoder-cache bookkeeping (images, audio)."""

from multimodal.hashing import hash_image
from multimodal.image_processor import (
    CLIPImageProcessor,
    ImageProcessor,
    ProcessedImage,
    Qwen2VLImageProcessor,
    SiglipImageProcessor,
    image_processor_from_config,
    load_image_processor,
)
from multimodal.media import MediaError, MediaLimits, load_image

__all__ = [
    "CLIPImageProcessor", "ImageProcessor", "MediaError", "MediaLimits", "ProcessedImage",
    "Qwen2VLImageProcessor", "SiglipImageProcessor", "hash_image", "image_processor_from_config",
    "load_image", "load_image_processor",
]
