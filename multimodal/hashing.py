"""Content hashes of images and audio, the keys under which processed images and encoder outputs are cached.

A hash covers everything that decides the processed result: the image's mode, size, raw pixel bytes,
its palette and transparency (a palette image's pixels are indices; its colors live in the palette),
and the processor's ``settings_key()``. Equal images under equal settings hash equal; a change to any
pixel or setting gives another hash.
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image


def hash_image(image: Image.Image, settings_key: str) -> str:
    """Hex BLAKE2b-256 of ``image``'s content and ``settings_key``."""
    h = hashlib.blake2b(digest_size=32)

    def add(part: bytes) -> None:   # length-prefixed, so no two sequences of parts hash alike
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)

    add(b"chorus-image-v1")
    add(settings_key.encode("utf-8"))
    add(image.mode.encode("ascii"))
    add(f"{image.width}x{image.height}".encode("ascii"))
    palette = image.getpalette("RGBA") if image.mode in ("P", "PA") else None
    add(bytes(palette or ()))
    add(repr(image.info.get("transparency")).encode("utf-8"))
    add(image.tobytes())
    return h.hexdigest()


def hash_audio(samples: np.ndarray, sample_rate_hz: int, settings_key: str) -> str:
    """Hex BLAKE2b-256 of decoded mono ``samples`` (float32), their rate and ``settings_key``."""
    h = hashlib.blake2b(digest_size=32)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    for part in (b"chorus-audio-v1", settings_key.encode("utf-8"), str(int(sample_rate_hz)).encode("ascii"),
                 memoryview(samples).cast("B")):   # no copy of the samples
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
