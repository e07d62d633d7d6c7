"""multimodal/image_processor.py against transformers' PIL-backend processors: the same float32 pixels
(max abs diff within 1e-5) and Qwen2-VL grids for many image modes, sizes and config settings;
building processors from config dicts and saved checkpoint directories."""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil, Qwen2VLImageProcessorPil, SiglipImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from multimodal.image_processor import (
    CLIPImageProcessor,
    ImageProcessor,
    Qwen2VLImageProcessor,
    SiglipImageProcessor,
    image_processor_from_config,
    load_image_processor,
    smart_resize,
)

TOLERANCE = 1e-5
LLAVA_15 = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}, "resample": 3,
            "rescale_factor": 0.00392156862745098, "image_processor_type": "CLIPImageProcessor",
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "processor_class": "LlavaProcessor"}
QWEN2_VL = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor"}


def noise(width_px: int, height_px: int, seed: int) -> Image.Image:
    """Random RGBA pixels with a smooth component (so resizes mix distinct values)."""
    rng = np.random.default_rng(seed)
    y = np.arange(height_px, dtype=np.uint8)[:, None, None]
    x = np.arange(width_px, dtype=np.uint8)[None, :, None]
    smooth = x * np.array([3, 1, 2, 5], np.uint8) + y * np.array([1, 4, 2, 7], np.uint8)   # wraps mod 256
    pixels = smooth + rng.integers(0, 64, (height_px, width_px, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA")


def with_mode(image: Image.Image, mode: str) -> Image.Image:
    if mode == "P+transparency":   # a palette image with one transparent index (GIF / PNG tRNS style)
        out = image.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        out.info["transparency"] = 3
        return out
    if mode == "RGB+tRNS":         # an RGB image with a transparent color
        out = image.convert("RGB")
        out.info["transparency"] = out.getpixel((0, 0))
        return out
    if mode == "P":
        return image.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=200)
    return image.convert(mode)


IMAGE_CASES = [("RGB", 1, 1), ("RGB", 3, 100), ("RGB", 100, 3), ("RGB", 37, 23), ("RGB", 224, 224),
               ("RGB", 640, 480), ("RGBA", 301, 199), ("L", 64, 100), ("LA", 50, 41), ("P", 99, 130),
               ("P+transparency", 70, 70), ("RGB+tRNS", 45, 60), ("CMYK", 120, 80), ("I;16", 33, 47),
               ("1", 40, 30), ("RGBA", 2, 2)]


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    return {f"{mode} {w}x{h}": with_mode(noise(w, h, seed=i), mode)
            for i, (mode, w, h) in enumerate(IMAGE_CASES)}


@pytest.fixture(scope="module")
def large_image() -> Image.Image:
    return noise(1600, 1200, seed=99).convert("RGB")


def reference(ref, image: Image.Image) -> tuple[torch.Tensor, tuple | None]:
    out = ref(image, return_tensors="np")
    pixels = torch.from_numpy(np.asarray(out["pixel_values"])).float()
    if "image_grid_thw" in out:
        return pixels, tuple(int(v) for v in out["image_grid_thw"][0])
    return pixels[0], None


def assert_same(ours: ImageProcessor, ref, image: Image.Image, label: str = "") -> None:
    """Equal outputs, or both refuse the image (a side resized to 0 px, an aspect ratio above 200)."""
    try:
        expected, grid = reference(ref, image)
    except ValueError:
        with pytest.raises(ValueError):
            ours(image)
        return
    got = ours(image)
    assert got.pixel_values.dtype == torch.float32
    assert got.pixel_values.shape == expected.shape, label
    assert got.grid_thw == grid, label
    diff = (got.pixel_values - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{label}: max abs diff {diff}"


CLIP_CONFIGS = {
    "defaults": {},
    "llava-1.5": LLAVA_15,
    "legacy int sizes": {"size": 64, "crop_size": 48},
    "height/width resize + crop": {"size": {"height": 90, "width": 120}, "crop_size": {"height": 80, "width": 100}},
    "crop larger than image (zero pad)": {"size": {"shortest_edge": 40}, "crop_size": {"height": 61, "width": 77}},
    "no crop": {"size": {"shortest_edge": 50}, "do_center_crop": False},
    "no resize": {"do_resize": False, "crop_size": {"height": 31, "width": 20}},
    "bilinear": {"size": {"shortest_edge": 70}, "crop_size": 70, "resample": 2},
    "nearest": {"size": {"shortest_edge": 70}, "crop_size": 70, "resample": 0},
    "lanczos": {"size": {"shortest_edge": 70}, "crop_size": 70, "resample": 1},
    "no rescale": {"size": 32, "crop_size": 32, "do_rescale": False},
    "no normalize": {"size": 32, "crop_size": 32, "do_normalize": False},
    "neither": {"size": 32, "crop_size": 32, "do_rescale": False, "do_normalize": False},
    "odd rescale and stats": {"size": 32, "crop_size": 30, "rescale_factor": 1 / 127.5,
                              "image_mean": [0.1, 0.9, 0.33], "image_std": [0.7, 0.05, 1.3]},
    "shortest+longest edge": {"size": {"shortest_edge": 60, "longest_edge": 80}, "do_center_crop": False},
    "max height/width": {"size": {"max_height": 50, "max_width": 70}, "do_center_crop": False},
    "kosmos-2 use_square_size": {"use_square_size": True, "do_center_crop": False},
}


SIGLIP_CONFIGS = {
    "defaults": {},
    "so400m 384": {"size": {"height": 384, "width": 384}, "resample": 3, "rescale_factor": 1 / 255,
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "bilinear non-square": {"size": {"height": 40, "width": 90}, "resample": 2},
    "scalar mean/std": {"size": {"height": 33, "width": 33}, "image_mean": 0.5, "image_std": 0.5},
}


QWEN_CONFIGS = {
    "defaults": {},
    "Qwen2-VL-7B preprocessor_config": QWEN2_VL,
    "small max_pixels (downscale)": {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 12},
    "large min_pixels (upscale)": {"min_pixels": 28 * 28 * 40, "max_pixels": 28 * 28 * 80},
    "size dict": {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 30}},
    "patch 16 merge 2": {"patch_size": 16, "max_pixels": 32 * 32 * 20},
    "merge 1 temporal 3": {"merge_size": 1, "temporal_patch_size": 3, "max_pixels": 14 * 14 * 50},
    "bilinear no normalize": {"resample": 2, "do_normalize": False, "max_pixels": 28 * 28 * 20},
}


PARITY_CASES = ([(CLIPImageProcessor, CLIPImageProcessorPil, name) for name in CLIP_CONFIGS]
                + [(SiglipImageProcessor, SiglipImageProcessorPil, name) for name in SIGLIP_CONFIGS]
                + [(Qwen2VLImageProcessor, Qwen2VLImageProcessorPil, name) for name in QWEN_CONFIGS])
CONFIGS = {CLIPImageProcessor: CLIP_CONFIGS, SiglipImageProcessor: SIGLIP_CONFIGS,
           Qwen2VLImageProcessor: QWEN_CONFIGS}


@pytest.mark.parametrize("ours_cls, ref_cls, name", PARITY_CASES,
                         ids=[f"{c.__name__}-{n}" for c, _, n in PARITY_CASES])
def test_matches_transformers(ours_cls, ref_cls, name, images):
    """Every image of ``images`` through one config: ours from ``from_dict``, transformers' from its own."""
    config = CONFIGS[ours_cls][name]
    ours, ref = ours_cls.from_dict(config), ref_cls.from_dict(config)
    for label, image in images.items():
        assert_same(ours, ref, image, f"{name} / {label}")


@pytest.mark.parametrize("size", [(3, 500), (500, 3)])
def test_thin_image_matches_transformers(size):
    """A 3 px side scaled to LLaVA's 336 px: the long side becomes 56000 px before the crop."""
    image = noise(*size, seed=5).convert("RGB")
    assert_same(CLIPImageProcessor.from_dict(LLAVA_15), CLIPImageProcessorPil(**LLAVA_15), image)
    assert_same(SiglipImageProcessor(), SiglipImageProcessorPil(), image)
    assert_same(Qwen2VLImageProcessor(), Qwen2VLImageProcessorPil(), image)


def test_large_image_matches_transformers(large_image):
    assert_same(CLIPImageProcessor.from_dict(LLAVA_15), CLIPImageProcessorPil(**LLAVA_15), large_image)
    assert_same(SiglipImageProcessor(), SiglipImageProcessorPil(), large_image)
    qwen = {"max_pixels": 1280 * 28 * 28}
    assert_same(Qwen2VLImageProcessor.from_dict(qwen), Qwen2VLImageProcessorPil(**qwen), large_image)


def test_without_rgb_conversion_matches_transformers(images):
    config = {"do_convert_rgb": False, "size": 40, "crop_size": 36}
    ours, ref = CLIPImageProcessor.from_dict(config), CLIPImageProcessorPil(**config)
    for label in ("RGB 37x23", "RGB 640x480"):
        assert_same(ours, ref, images[label], label)
    one_channel = {**config, "image_mean": 0.5, "image_std": 0.25}
    assert_same(CLIPImageProcessor.from_dict(one_channel), CLIPImageProcessorPil(**one_channel), images["L 64x100"])
    with pytest.raises(ValueError, match="need 1 or 4 values"):
        ours(images["RGBA 301x199"])
    with pytest.raises(ValueError, match="needs do_convert_rgb=True"):
        ours(images["I;16 33x47"])


def test_qwen2_vl_output_layout():
    """The flattened patch order: patch (row, col) of a merge block, then channel, frame, pixel row, col."""
    processor = Qwen2VLImageProcessor(do_resize=False, do_rescale=False, do_normalize=False, patch_size=2,
                                      merge_size=2, temporal_patch_size=2)
    pixels = np.arange(8 * 4 * 3).reshape(8, 4, 3) % 256   # [H, W, C], H = 8 rows of 2x2 patches
    out = processor(Image.fromarray(pixels.astype(np.uint8)))
    assert out.grid_thw == (1, 4, 2)
    assert out.pixel_values.shape == (8, 3 * 2 * 2 * 2)
    first = out.pixel_values[0].reshape(3, 2, 2, 2)          # [C, T, P, P] of the top-left patch
    assert torch.equal(first[:, 0], first[:, 1])              # a still image repeats across frames
    assert torch.equal(first[:, 0].permute(1, 2, 0), torch.from_numpy(pixels[:2, :2]).float())
    second = out.pixel_values[1].reshape(3, 2, 2, 2)         # the next patch of the same 2x2 merge block
    assert torch.equal(second[:, 0].permute(1, 2, 0), torch.from_numpy(pixels[:2, 2:4]).float())
    third = out.pixel_values[2].reshape(3, 2, 2, 2)          # the block's second patch row
    assert torch.equal(third[:, 0].permute(1, 2, 0), torch.from_numpy(pixels[2:4, :2]).float())


def test_smart_resize_and_num_patches_match_transformers():
    rng = random.Random(0)
    ours, ref = Qwen2VLImageProcessor.from_dict(QWEN2_VL), Qwen2VLImageProcessorPil.from_dict(QWEN2_VL)
    small = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    sizes = [(1, 1), (1, 199), (28, 28), (27, 29), (4000, 3000), (10000, 50)]
    sizes += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(300)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for p in (ours, small):
            assert smart_resize(h, w, 28, p.min_pixels, p.max_pixels) == hf_smart_resize(
                h, w, 28, p.min_pixels, p.max_pixels)
        t, gh, gw = ours.num_patches_for(h, w)
        assert t == 1 and gh * gw == ref.get_number_of_image_patches(h, w)
        rh, rw = small.resized_size(h, w)
        assert rh % 28 == 0 and rw % 28 == 0 and rh * rw >= 28 * 28 * 4


@pytest.mark.parametrize("size", [(1, 1), (3, 500), (640, 480), (1000, 37), (333, 777)])
def test_num_patches_for_equals_processed_grid(size):
    processor = Qwen2VLImageProcessor(max_pixels=28 * 28 * 100)
    width, height = size
    out = processor(noise(width, height, seed=1))
    assert processor.num_patches_for(height, width) == out.grid_thw
    assert out.pixel_values.shape[0] == math.prod(out.grid_thw)


def test_qwen2_vl_refuses_extreme_aspect_ratio():
    processor = Qwen2VLImageProcessor()
    with pytest.raises(ValueError, match="aspect ratio above 200"):
        processor.num_patches_for(1, 201)
    with pytest.raises(ValueError, match="multiples of 28"):
        Qwen2VLImageProcessor(do_resize=False).num_patches_for(30, 56)


def test_defaults_equal_transformers():
    for ours, ref in ((CLIPImageProcessor(), CLIPImageProcessorPil()),
                      (SiglipImageProcessor(), SiglipImageProcessorPil()),
                      (Qwen2VLImageProcessor(), Qwen2VLImageProcessorPil())):
        hf = ref.to_dict()
        assert ours.do_resize == hf["do_resize"] and ours.resample == int(hf["resample"])
        assert ours.rescale_factor == hf["rescale_factor"] and ours.do_normalize == hf["do_normalize"]
        assert ours.image_mean == tuple(hf["image_mean"]) and ours.image_std == tuple(hf["image_std"])
        if isinstance(ours, Qwen2VLImageProcessor):
            assert (ours.min_pixels, ours.max_pixels) == (hf["size"]["shortest_edge"], hf["size"]["longest_edge"])
            assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (14, 2, 2)
        else:
            assert ours.size == hf["size"] and ours.do_center_crop == bool(hf.get("do_center_crop"))
            assert ours.crop_size == hf.get("crop_size")


@pytest.mark.parametrize("ref_cls, config, expected_cls", [
    (CLIPImageProcessorPil, LLAVA_15, CLIPImageProcessor),
    (SiglipImageProcessorPil, {"size": {"height": 48, "width": 64}, "resample": 2}, SiglipImageProcessor),
    (Qwen2VLImageProcessorPil, {"min_pixels": 1000, "max_pixels": 28 * 28 * 30, "patch_size": 16},
     Qwen2VLImageProcessor),
])
def test_load_saved_transformers_processor(tmp_path, images, ref_cls, config, expected_cls):
    ref = ref_cls(**config)
    ref.save_pretrained(tmp_path)
    loaded = load_image_processor(tmp_path)
    assert type(loaded) is expected_cls
    assert loaded == expected_cls.from_dict(ref.to_dict())
    for label in ("RGB 640x480", "P 99x130", "RGBA 301x199"):
        assert_same(loaded, ref, images[label], label)


def test_processor_config_section_comes_first(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(LLAVA_15))
    nested = {"image_processor": {**QWEN2_VL, "image_processor_type": "Qwen2VLImageProcessorFast"},
              "processor_class": "Qwen2VLProcessor"}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert load_image_processor(tmp_path) == Qwen2VLImageProcessor(max_pixels=12845056)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    assert load_image_processor(tmp_path) == CLIPImageProcessor.from_dict(LLAVA_15)


def test_missing_config_says_which_file(tmp_path):
    with pytest.raises(ValueError, match="preprocessor_config.json is missing"):
        load_image_processor(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_image_processor(tmp_path / "nowhere")
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_image_processor(tmp_path)


def test_dispatch_on_image_processor_type():
    for name, cls in (("CLIPImageProcessor", CLIPImageProcessor), ("CLIPImageProcessorFast", CLIPImageProcessor),
                      ("SiglipImageProcessor", SiglipImageProcessor),
                      ("SiglipImageProcessorFast", SiglipImageProcessor),
                      ("Qwen2VLImageProcessor", Qwen2VLImageProcessor),
                      ("Qwen2VLImageProcessorFast", Qwen2VLImageProcessor)):
        assert type(image_processor_from_config({"image_processor_type": name})) is cls
    assert type(image_processor_from_config({"feature_extractor_type": "CLIPFeatureExtractor"})) is CLIPImageProcessor
    with pytest.raises(ValueError, match="'LlavaNextImageProcessor' is not supported; supported: CLIPImageProcessor"):
        image_processor_from_config({"image_processor_type": "LlavaNextImageProcessor"})
    with pytest.raises(ValueError, match="None is not supported"):
        image_processor_from_config({})


def test_unknown_keys_ignored_and_none_keeps_default():
    processor = CLIPImageProcessor.from_dict({**LLAVA_15, "some_future_key": 1, "do_normalize": None})
    assert processor == CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})


def test_invalid_settings_are_value_errors():
    with pytest.raises(ValueError, match="size=.*is not supported"):
        CLIPImageProcessor(size={"longest_edge": 100})
    with pytest.raises(ValueError, match="do_center_crop needs crop_size"):
        CLIPImageProcessor(crop_size=None)
    with pytest.raises(ValueError, match="not a PIL filter"):
        SiglipImageProcessor(resample=9)
    with pytest.raises(ValueError, match="nonzero image_std"):
        SiglipImageProcessor(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="min_pixels .* is above max_pixels"):
        Qwen2VLImageProcessor(min_pixels=5000, max_pixels=4000)
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
        Qwen2VLImageProcessor(patch_size=0)


def test_settings_key_covers_every_field():
    base = CLIPImageProcessor.from_dict(LLAVA_15)
    assert base.settings_key() == CLIPImageProcessor.from_dict(json.loads(json.dumps(LLAVA_15))).settings_key()
    changed = [CLIPImageProcessor.from_dict({**LLAVA_15, key: value}) for key, value in (
        ("size", {"shortest_edge": 337}), ("crop_size", 335), ("resample", 2), ("do_center_crop", False),
        ("do_rescale", False), ("rescale_factor", 1 / 256), ("do_normalize", False), ("do_resize", False),
        ("image_mean", [0.5, 0.5, 0.5]), ("image_std", [0.5, 0.5, 0.5]), ("do_convert_rgb", False))]
    changed += [SiglipImageProcessor.from_dict(LLAVA_15), Qwen2VLImageProcessor(), Qwen2VLImageProcessor(merge_size=1)]
    keys = {p.settings_key() for p in [base, *changed]}
    assert len(keys) == 1 + len(changed)


def test_thread_safe(images):
    processor = CLIPImageProcessor.from_dict(LLAVA_15)
    labels = list(images) * 3
    expected = {label: processor(images[label]).pixel_values for label in images}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda label: processor(images[label]).pixel_values, labels))
    assert all(torch.equal(r, expected[label]) for r, label in zip(results, labels))
