"""Image preprocessing for the vision towers: a PIL image in, the tower's ``pixel_values`` out.

Three processors, each equal to transformers' PIL backend of the same name (``CLIPImageProcessorPil``,
``SiglipImageProcessorPil``, ``Qwen2VLImageProcessorPil``) step for step, without importing transformers:

1. convert to RGB, compositing any transparency onto white (transformers' ``convert_to_rgb``);
2. resize with PIL (CLIP / SigLIP: shortest edge or a fixed size; Qwen2-VL: ``smart_resize`` to multiples
   of ``patch_size * merge_size``);
3. center crop, padding with zeros where the image is smaller than the crop (CLIP);
4. rescale then normalize. Every step before this one yields uint8, so the float result of a pixel depends
   only on its byte value and channel: it is read from a ``[C, 256]`` table computed once with transformers'
   own order and precision (rescale in float64, cast to float32, ``(x - mean) / std`` in float32), which
   makes the output bit-identical to transformers' and costs one gather per value;
5. Qwen2-VL only: cut into ``patch_size`` patches, grouped ``merge_size x merge_size``, each repeated
   ``temporal_patch_size`` times, flattened in transformers' order.

``image_processor_from_config`` and ``load_image_processor`` build a processor from a checkpoint's
``preprocessor_config.json`` (or the ``image_processor`` section of ``processor_config.json``).
Processors are frozen dataclasses with no mutable state, so one instance serves many threads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
BICUBIC = int(Image.Resampling.BICUBIC)
RESAMPLE_FILTERS = {int(r): r.name for r in Image.Resampling}
"""PIL resampling filters by their config value (``"resample": 3`` is bicubic)."""

SIZE_KEY_SETS = ({"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"height", "width"},
                 {"max_height", "max_width"})
"""The ``size`` dicts a CLIP / SigLIP processor resizes by (transformers' PIL backend's cases)."""


@dataclass
class ProcessedImage:
    """One image's model input."""

    pixel_values: torch.Tensor
    """CLIP / SigLIP: ``[C, H, W]`` float32. Qwen2-VL: ``[num_patches, C * T * P * P]`` float32, where
    ``num_patches = t * h * w`` of ``grid_thw``."""
    grid_thw: Optional[tuple[int, int, int]]
    """Qwen2-VL: (temporal, height, width) in patches; None for CLIP / SigLIP."""


class ImageProcessor:
    """Base of the processors: ``__call__`` turns one PIL image into a ``ProcessedImage``."""

    def __call__(self, image: Image.Image) -> ProcessedImage:
        raise NotImplementedError

    def settings_key(self) -> str:
        """A stable string over the processor type and every field: equal keys give equal outputs."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return f"{type(self).__name__}:{json.dumps(values, sort_keys=True, separators=(',', ':'))}"

    @classmethod
    def from_dict(cls, config: dict[str, Any]):
        """The processor of a ``preprocessor_config.json`` dict; unknown keys are ignored, and keys set
        to None keep the default (as transformers does)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band, a palette or tRNS transparent color) composited onto
    white: transformers' ``convert_to_rgb``."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def as_uint8_image(image: Image.Image, do_convert_rgb: bool) -> Image.Image:
    """The 8-bit image the resize sees. Without RGB conversion transformers round-trips the pixels through
    a numpy array, so the PIL mode becomes the one ``Image.fromarray`` gives that array (CMYK -> RGBA,
    P -> L of palette indices); modes that are not 8 bits per band are refused."""
    if do_convert_rgb:
        return convert_to_rgb(image)
    if image.mode in ("L", "LA", "RGB", "RGBA"):
        return image
    array = np.asarray(image)
    if array.dtype != np.uint8:
        raise ValueError(f"an image of mode {image.mode!r} needs do_convert_rgb=True (without it only 8-bit "
                         f"modes are processed); convert the image or enable do_convert_rgb")
    return Image.fromarray(array)


def value_table(num_channels: int, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``[C, 256]`` float32: the processed value of each byte value per channel, computed with
    transformers' ops (``rescale``: float64 multiply then float32; ``normalize``: float32)."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (num_channels, 256))
    if do_rescale:
        values = (values.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        if len(mean) not in (1, num_channels) or len(std) not in (1, num_channels):
            raise ValueError(f"image_mean {mean} and image_std {std} need 1 or {num_channels} values for an "
                             f"image of {num_channels} channels; keep do_convert_rgb on for RGB models")
        if not np.issubdtype(values.dtype, np.floating):
            values = values.astype(np.float32)
        mean_c = np.broadcast_to(np.array(mean, dtype=values.dtype), (num_channels,))[:, None]
        std_c = np.broadcast_to(np.array(std, dtype=values.dtype), (num_channels,))[:, None]
        values = (values - mean_c) / std_c
    table = np.array(values, dtype=np.float32, order="C")
    table.setflags(write=False)   # shared by every call (and thread) of a processor
    return table


def pixels_hwc(image: Image.Image) -> np.ndarray:
    """``[H, W, C]`` uint8 view of an 8-bit PIL image (one channel for L)."""
    array = np.asarray(image)
    return array[:, :, None] if array.ndim == 2 else array


def lookup_chw(pixels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``[H, W, C]`` uint8 -> ``[C, H, W]`` float32 through the per-channel value table."""
    height, width, num_channels = pixels.shape
    out = np.empty((num_channels, height, width), dtype=np.float32)  # [C, H, W]
    for c in range(num_channels):
        np.take(table[c], pixels[:, :, c], out=out[c])
    return out


def as_tuple(values: Any) -> tuple[float, ...]:
    """``image_mean`` / ``image_std`` as a tuple (a config may give one float for every channel)."""
    return tuple(float(v) for v in values) if isinstance(values, (list, tuple)) else (float(values),)


def size_dict(size: Any, default_to_square: bool, name: str) -> dict[str, int]:
    """A config's ``size`` / ``crop_size`` as a dict: an int is the shortest edge (or a square with
    ``default_to_square``), a pair is (height, width) (transformers' ``get_size_dict``)."""
    if isinstance(size, dict):
        return {k: int(v) for k, v in size.items() if v is not None}
    if isinstance(size, int):
        return {"height": size, "width": size} if default_to_square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    raise ValueError(f"{name}={size!r} is not a size; give a dict such as {{'height': 336, 'width': 336}} "
                     f"or {{'shortest_edge': 336}}, an int, or a (height, width) pair")


def resize_output_size(height_px: int, width_px: int, size: dict[str, int]) -> tuple[int, int]:
    """(height, width) after the resize of transformers' PIL backend for this ``size`` dict."""
    if "shortest_edge" in size and "longest_edge" in size:
        return size_with_aspect_ratio(height_px, width_px, size["shortest_edge"], size["longest_edge"])
    if "shortest_edge" in size:
        target = size["shortest_edge"]
        short, long = (width_px, height_px) if width_px <= height_px else (height_px, width_px)
        new_short, new_long = target, int(target * long / short)
        return (new_long, new_short) if width_px <= height_px else (new_short, new_long)
    if "max_height" in size:
        scale = min(size["max_height"] / height_px, size["max_width"] / width_px)
        return int(height_px * scale), int(width_px * scale)
    return size["height"], size["width"]


def size_with_aspect_ratio(height_px: int, width_px: int, shortest: int, longest: int) -> tuple[int, int]:
    """transformers' ``get_size_with_aspect_ratio``: the shortest edge to ``shortest`` unless the longest
    edge would pass ``longest``."""
    raw_size = None
    min_side, max_side = float(min(height_px, width_px)), float(max(height_px, width_px))
    if max_side / min_side * shortest > longest:
        raw_size = longest * min_side / max_side
        shortest = int(round(raw_size))
    if (height_px <= width_px and height_px == shortest) or (width_px <= height_px and width_px == shortest):
        return height_px, width_px
    if width_px < height_px:
        out_h = int(raw_size * height_px / width_px) if raw_size is not None else int(shortest * height_px / width_px)
        return out_h, shortest
    out_w = int(raw_size * width_px / height_px) if raw_size is not None else int(shortest * width_px / height_px)
    return shortest, out_w


def center_crop_hwc(pixels: np.ndarray, crop_height_px: int, crop_width_px: int) -> np.ndarray:
    """transformers' ``center_crop`` on ``[H, W, C]``: the centered window (offsets rounded down), the
    image zero-padded (extra row / column at the top / left) where it is smaller than the crop."""
    height, width = pixels.shape[:2]
    top, left = (height - crop_height_px) // 2, (width - crop_width_px) // 2
    bottom, right = top + crop_height_px, left + crop_width_px
    if top >= 0 and bottom <= height and left >= 0 and right <= width:
        return pixels[top:bottom, left:right]
    new_height, new_width = max(crop_height_px, height), max(crop_width_px, width)
    padded = np.zeros((new_height, new_width, pixels.shape[2]), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_height - height) / 2), math.ceil((new_width - width) / 2)
    padded[top_pad:top_pad + height, left_pad:left_pad + width] = pixels
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[max(0, top):min(new_height, bottom), max(0, left):min(new_width, right)]


@dataclass(frozen=True)
class PixelValueProcessor(ImageProcessor):
    """The settings every processor shares: RGB conversion, the resize filter, rescale and normalize,
    and the value table they make (kept per instance, never changed after construction)."""

    resample: int = BICUBIC
    """PIL resampling filter of the resize (2 bilinear, 3 bicubic, ...)."""
    do_rescale: bool = True
    """Multiply byte values by ``rescale_factor``."""
    rescale_factor: float = 1 / 255
    """The rescale multiplier."""
    do_normalize: bool = True
    """Subtract ``image_mean`` and divide by ``image_std`` per channel."""
    image_mean: tuple = OPENAI_CLIP_MEAN
    """Per-channel mean (one value: every channel)."""
    image_std: tuple = OPENAI_CLIP_STD
    """Per-channel standard deviation (one value: every channel)."""
    do_convert_rgb: bool = True
    """Convert to RGB first, compositing transparency onto white."""

    def __post_init__(self) -> None:
        mean, std = as_tuple(self.image_mean), as_tuple(self.image_std)
        if self.resample not in RESAMPLE_FILTERS:
            raise ValueError(f"resample={self.resample!r} is not a PIL filter; use one of {RESAMPLE_FILTERS}")
        if self.do_rescale and not self.rescale_factor > 0:
            raise ValueError(f"rescale_factor must be positive, got {self.rescale_factor!r}")
        if self.do_normalize and (not mean or not std or any(s == 0 for s in std)):
            raise ValueError(f"do_normalize needs image_mean and a nonzero image_std, got {mean} / {std}")
        object.__setattr__(self, "image_mean", mean)
        object.__setattr__(self, "image_std", std)
        object.__setattr__(self, "_rgb_table", value_table(3, self.do_rescale, self.rescale_factor,
                                                           self.do_normalize, mean, std))

    def table(self, num_channels: int) -> np.ndarray:
        """``[C, 256]`` value table for images of ``num_channels`` channels."""
        if num_channels == 3:
            return self._rgb_table
        return value_table(num_channels, self.do_rescale, self.rescale_factor, self.do_normalize,
                           self.image_mean, self.image_std)


@dataclass(frozen=True)
class ResizeCropImageProcessor(PixelValueProcessor):
    """Resize, optional center crop, rescale, normalize: one ``[C, H, W]`` image (CLIP and SigLIP).
    The defaults are CLIP's; ``SiglipImageProcessor`` changes them."""

    do_resize: bool = True
    """Resize by ``size`` first."""
    size: dict = field(default_factory=lambda: {"shortest_edge": 224})
    """{"shortest_edge"} (aspect kept, short side to it), {"height", "width"} (exact),
    {"shortest_edge", "longest_edge"} or {"max_height", "max_width"}; an int means {"shortest_edge"}."""
    do_center_crop: bool = True
    """Center crop to ``crop_size`` after the resize (zero padding where the image is smaller)."""
    crop_size: Optional[dict] = field(default_factory=lambda: {"height": 224, "width": 224})
    """{"height", "width"} of the crop; an int means a square."""

    def __post_init__(self) -> None:
        super().__post_init__()
        size = size_dict(self.size, default_to_square=False, name="size")
        if set(size) not in SIZE_KEY_SETS or min(size.values()) <= 0:
            raise ValueError(f"size={self.size!r} is not supported; use positive {{'shortest_edge'}}, "
                             f"{{'height', 'width'}}, {{'shortest_edge', 'longest_edge'}} or "
                             f"{{'max_height', 'max_width'}}")
        object.__setattr__(self, "size", size)
        if self.crop_size is not None:
            crop = size_dict(self.crop_size, default_to_square=True, name="crop_size")
            if set(crop) != {"height", "width"} or min(crop.values()) <= 0:
                raise ValueError(f"crop_size={self.crop_size!r} needs positive 'height' and 'width'")
            object.__setattr__(self, "crop_size", crop)
        elif self.do_center_crop:
            raise ValueError("do_center_crop needs crop_size, e.g. {'height': 336, 'width': 336}")

    def __call__(self, image: Image.Image) -> ProcessedImage:
        image = as_uint8_image(image, self.do_convert_rgb)
        if self.do_resize:
            height, width = resize_output_size(image.height, image.width, self.size)
            if height <= 0 or width <= 0:
                raise ValueError(f"an image of {image.width}x{image.height} px is too thin for size={self.size}: "
                                 f"it would resize to {width}x{height} px")
            if (width, height) != image.size:
                image = image.resize((width, height), resample=self.resample)
        pixels = pixels_hwc(image)  # [H, W, C] uint8
        if self.do_center_crop:
            pixels = center_crop_hwc(pixels, self.crop_size["height"], self.crop_size["width"])
        table = self.table(pixels.shape[2])
        return ProcessedImage(pixel_values=torch.from_numpy(lookup_chw(pixels, table)), grid_thw=None)


@dataclass(frozen=True)
class CLIPImageProcessor(ResizeCropImageProcessor):
    """CLIP (and LLaVA-1.5): shortest edge to ``size``, center crop, OpenAI CLIP mean / std.
    Defaults equal transformers' ``CLIPImageProcessor`` (224 px); LLaVA-1.5 configs say 336."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "CLIPImageProcessor":
        if config.get("use_square_size"):   # transformers' Kosmos-2 compatibility: a square of 224 px
            config = {**config, "size": {"height": 224, "width": 224}}
        return super().from_dict(config)


@dataclass(frozen=True)
class SiglipImageProcessor(ResizeCropImageProcessor):
    """SigLIP: bicubic resize to a fixed {"height", "width"}, no crop, mean = std = 0.5.
    Defaults equal transformers' ``SiglipImageProcessor``."""

    size: dict = field(default_factory=lambda: {"height": 224, "width": 224})
    do_center_crop: bool = False
    crop_size: Optional[dict] = None
    image_mean: tuple = IMAGENET_STANDARD_MEAN
    image_std: tuple = IMAGENET_STANDARD_STD


@dataclass(frozen=True)
class Gemma3ImageProcessor(SiglipImageProcessor):
    """Gemma 3: SigLIP's processing with a bilinear resize (transformers' ``Gemma3ImageProcessor``
    defaults); pan-and-scan crops are not supported (refused)."""

    resample: int = 2
    do_pan_and_scan: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.do_pan_and_scan:
            raise ValueError("Gemma 3 do_pan_and_scan=True is not supported (one crop per image).")


def smart_resize(height_px: int, width_px: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target (height, width): both multiples of ``factor``, the area within
    [``min_pixels``, ``max_pixels``], the aspect ratio kept as closely as that allows."""
    if max(height_px, width_px) / min(height_px, width_px) > 200:
        raise ValueError(f"an image of {width_px}x{height_px} px has an aspect ratio above 200, which Qwen2-VL "
                         f"cannot take; crop or pad it first")
    h_bar = round(height_px / factor) * factor
    w_bar = round(width_px / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height_px * width_px) / max_pixels)
        h_bar = max(factor, math.floor(height_px / beta / factor) * factor)
        w_bar = max(factor, math.floor(width_px / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height_px * width_px))
        h_bar = math.ceil(height_px * beta / factor) * factor
        w_bar = math.ceil(width_px * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLImageProcessor(PixelValueProcessor):
    """Qwen2-VL (and Qwen2.5-VL): ``smart_resize``, rescale, normalize, then flattened patches.
    Defaults equal transformers' ``Qwen2VLImageProcessor``."""

    do_resize: bool = True
    """Resize by ``smart_resize`` (without it the image sides must already be multiples of
    ``patch_size * merge_size``)."""
    min_pixels: int = 56 * 56
    """Smallest area after the resize, scaling smaller images up (transformers' ``size["shortest_edge"]``)."""
    max_pixels: int = 28 * 28 * 1280
    """Area limit of the resize, scaling larger images down (transformers' ``size["longest_edge"]``)."""
    patch_size: int = 14
    """Side of one vision patch, px."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated this many times."""
    merge_size: int = 2
    """Patches merged per side into one LLM token (a token covers ``merge_size**2`` patches)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is above max_pixels ({self.max_pixels})")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "Qwen2VLImageProcessor":
        """As transformers: ``size`` {"shortest_edge", "longest_edge"} (or {"min_pixels", "max_pixels"})
        gives the pixel bounds, and top-level ``min_pixels`` / ``max_pixels`` override it."""
        config = dict(config)
        size = config.pop("size", None) or {}
        if not isinstance(size, dict):
            raise ValueError(f"Qwen2-VL size={size!r} must be a dict with 'shortest_edge' and 'longest_edge'")
        for key, size_keys in (("min_pixels", ("shortest_edge", "min_pixels")),
                               ("max_pixels", ("longest_edge", "max_pixels"))):
            if config.get(key) is None:
                config[key] = next((size[k] for k in size_keys if size.get(k) is not None), None)
        return super().from_dict(config)

    @property
    def factor_px(self) -> int:
        """Resized sides are multiples of this: one merged token's side, px."""
        return self.patch_size * self.merge_size

    def resized_size(self, height_px: int, width_px: int) -> tuple[int, int]:
        """(height, width) in px the image is processed at."""
        if self.do_resize:
            return smart_resize(height_px, width_px, self.factor_px, self.min_pixels, self.max_pixels)
        if height_px % self.factor_px or width_px % self.factor_px:
            raise ValueError(f"with do_resize=False the image sides must be multiples of {self.factor_px} px, "
                             f"got {width_px}x{height_px}; enable do_resize")
        return height_px, width_px

    def num_patches_for(self, height_px: int, width_px: int) -> tuple[int, int, int]:
        """(grid_t, grid_h, grid_w) in patches of an image of this size, without processing it;
        ``grid_t * grid_h * grid_w // merge_size**2`` is its number of LLM tokens."""
        resized_h, resized_w = self.resized_size(height_px, width_px)
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def __call__(self, image: Image.Image) -> ProcessedImage:
        image = as_uint8_image(image, self.do_convert_rgb)
        height, width = self.resized_size(image.height, image.width)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=self.resample)
        pixels = pixels_hwc(image)  # [H, W, C] uint8
        num_channels = pixels.shape[2]
        values = lookup_chw(pixels, self.table(num_channels))  # [C, H, W]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        blocks = values.reshape(num_channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # [.., C, T, P, P]
        patches = blocks.reshape(grid_h * grid_w, num_channels * t * p * p)  # [num_patches, C*T*P*P]
        return ProcessedImage(pixel_values=torch.from_numpy(patches), grid_thw=(1, grid_h, grid_w))


PROCESSORS: dict[str, type[ImageProcessor]] = {
    "CLIPImageProcessor": CLIPImageProcessor,
    "SiglipImageProcessor": SiglipImageProcessor,
    "Gemma3ImageProcessor": Gemma3ImageProcessor,
    "Qwen2VLImageProcessor": Qwen2VLImageProcessor,
}
"""Processor classes by transformers' ``image_processor_type`` (the ``Fast`` / ``Pil`` variants map here)."""
FEATURE_EXTRACTORS = {"CLIPFeatureExtractor": "CLIPImageProcessor"}
"""Old checkpoints name a feature extractor instead of an image processor."""


def image_processor_from_config(config: dict[str, Any]) -> ImageProcessor:
    """The processor a ``preprocessor_config.json`` dict names in ``image_processor_type``."""
    name = config.get("image_processor_type") or FEATURE_EXTRACTORS.get(config.get("feature_extractor_type", ""))
    base = name
    for suffix in ("Fast", "Pil"):
        if base and base.endswith(suffix):
            base = base[:-len(suffix)]
    if base not in PROCESSORS:
        supported = ", ".join(f"{n} (or {n}Fast)" for n in PROCESSORS)
        raise ValueError(f"image_processor_type {name!r} is not supported; supported: {supported}")
    return PROCESSORS[base].from_dict(config)


def load_image_processor(model_dir: str | Path) -> ImageProcessor:
    """The processor of a checkpoint directory: the ``image_processor`` section of
    ``processor_config.json`` when it has one (newer checkpoints), else ``preprocessor_config.json``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist")
    processor_file, preprocessor_file = model_dir / "processor_config.json", model_dir / "preprocessor_config.json"
    if processor_file.is_file():
        section = read_json(processor_file).get("image_processor")
        if isinstance(section, dict):
            return image_processor_from_config(section)
    if not preprocessor_file.is_file():
        raise ValueError(f"{preprocessor_file} is missing (and {processor_file.name} has no 'image_processor' "
                         f"section); a vision checkpoint needs its image processor config")
    return image_processor_from_config(read_json(preprocessor_file))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
