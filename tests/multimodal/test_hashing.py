"""multimodal/hashing.py: equal content and settings hash equal; any pixel, mode, size, palette,
transparency or setting change hashes differently."""

from __future__ import annotations

import numpy as np
from PIL import Image

from multimodal.hashing import hash_image
from multimodal.image_processor import CLIPImageProcessor

KEY = CLIPImageProcessor().settings_key()


def picture(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (16, 12, 3), dtype=np.uint8))


def test_equal_images_equal_hashes():
    a, b = picture(), picture()
    assert a is not b
    digest = hash_image(a, KEY)
    assert digest == hash_image(b, KEY) == hash_image(a.copy(), KEY)
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_one_pixel_changes_the_hash():
    a = picture()
    b = a.copy()
    r, g, bl = b.getpixel((5, 7))
    b.putpixel((5, 7), (r, g, bl ^ 1))
    assert hash_image(a, KEY) != hash_image(b, KEY)


def test_settings_change_the_hash():
    a = picture()
    other = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size=336).settings_key()
    assert hash_image(a, KEY) != hash_image(a, other)
    assert hash_image(a, KEY) != hash_image(a, KEY + " ")


def test_mode_and_size_are_part_of_the_hash():
    raw = bytes(range(64))
    assert hash_image(Image.frombytes("L", (8, 8), raw), KEY) != hash_image(Image.frombytes("L", (4, 16), raw), KEY)
    gray = Image.frombytes("L", (8, 8), raw)
    palette = Image.frombytes("P", (8, 8), raw)
    palette.putpalette([i for v in range(256) for i in (v, v, v)])
    assert gray.tobytes() == palette.tobytes()
    assert hash_image(gray, KEY) != hash_image(palette, KEY)


def test_palette_and_transparency_are_part_of_the_hash():
    indices = bytes(range(64))
    a = Image.frombytes("P", (8, 8), indices)
    a.putpalette([i for v in range(256) for i in (v, v, v)])
    b = a.copy()
    b.putpalette([i for v in range(256) for i in (v, 255 - v, v)])   # same indices, other colors
    assert hash_image(a, KEY) != hash_image(b, KEY)
    c = a.copy()
    c.info["transparency"] = 3                                         # index 3 becomes see-through
    assert hash_image(a, KEY) != hash_image(c, KEY)
    rgb = picture()
    keyed = rgb.copy()
    keyed.info["transparency"] = (0, 0, 0)
    assert hash_image(rgb, KEY) != hash_image(keyed, KEY)
