"""Hostile media bytes through the image and audio decoders (``multimodal/media.py``,
``multimodal/audio.py``): every input gives a decoded result or the decoders' own error
(``MediaError`` / ``AudioError``, both 400s), never another exception, within a time bound, and the
inputs that are refused from their headers (huge declared sizes, decompression bombs, hours of audio in
a few kilobytes) are refused before they take memory.

The fuzz cases are deterministic: fixed seeds, a few hundred mutations (truncation, bit flips, random
bytes, extreme 32-bit values written over header fields, inserted, deleted and duplicated ranges,
another format's magic) of the committed recordings in ``tests/data/audio`` and of images encoded
here in every accepted format. A failure names the seed and mutation that reproduce it.
"""

from __future__ import annotations

import functools
import io
import json
import random
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from multimodal.audio import AudioError, AudioLimits, load_audio
from multimodal.media import MediaError, MediaLimits, load_image

AUDIO_DIR = Path(__file__).resolve().parents[1] / "data" / "audio"
AUDIO_SEEDS = ("fox.wav", "fox.flac", "fox.mp3", "fox.ogg", "fox.m4a", "fox.webm")
NUM_MUTATIONS = 400
"""Per modality; each mutation is one seed of ``random.Random``."""
CASE_TIME_BOUND_S = 5.0
"""Per input; typical cases take milliseconds, a full decode of a recording well under a second."""
MAGICS = (b"\x89PNG", b"\xff\xd8\xff\xe0", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"fLaC", b"OggS", b"ID3\x03",
          b"\x00\x00\x00\x20ftyp", b"\x1a\x45\xdf\xa3", b".snd", b"FORM")
EXTREMES = (b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x80\x00\x00\x00", b"\x00\x00\x00\x00", b"\x00\x01\x86\xa0")


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def image_seeds() -> dict[str, bytes]:
    """A small noisy picture in every accepted format (PNG, JPEG, progressive JPEG, GIF, WebP, BMP,
    TIFF, deflate TIFF)."""
    pixels = np.random.default_rng(0).integers(0, 255, (24, 32, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels)
    return {"png": _encode(picture, "PNG"), "jpeg": _encode(picture, "JPEG", quality=85),
            "jpeg-progressive": _encode(picture, "JPEG", progressive=True), "gif": _encode(picture, "GIF"),
            "webp": _encode(picture, "WEBP"), "bmp": _encode(picture, "BMP"), "tiff": _encode(picture, "TIFF"),
            "tiff-deflate": _encode(picture, "TIFF", compression="tiff_deflate")}


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of ``data`` and its description."""
    d = bytearray(data)
    op = rng.choice(["truncate", "flip", "bytes", "extreme", "insert", "delete", "duplicate", "magic", "noise"])
    i = rng.randrange(len(d))
    if op == "truncate":
        return bytes(d[:i]), f"truncate at {i}"
    if op == "flip":
        spots = [rng.randrange(len(d)) for _ in range(rng.randint(1, 8))]
        for k in spots:
            d[k] ^= 1 << rng.randrange(8)
        return bytes(d), f"flip bits at {spots}"
    if op == "bytes":
        spots = [rng.randrange(len(d)) for _ in range(rng.randint(1, 8))]
        for k in spots:
            d[k] = rng.randrange(256)
        return bytes(d), f"random bytes at {spots}"
    if op == "extreme":   # header fields: sizes, dimensions, counts, rates
        at = rng.randrange(min(len(d) - 4, 96)) if rng.random() < 0.7 else rng.randrange(len(d) - 4)
        value = rng.choice(EXTREMES)
        d[at:at + 4] = value
        return bytes(d), f"{value.hex()} at {at}"
    if op == "insert":
        chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return bytes(d[:i] + chunk + d[i:]), f"insert {len(chunk)} bytes at {i}"
    if op == "delete":
        j = min(len(d), i + rng.randint(1, 512))
        return bytes(d[:i] + d[j:]), f"delete [{i}, {j})"
    if op == "duplicate":
        j = min(len(d), i + rng.randint(1, 4096))
        return bytes(d[:j] + d[i:j] + d[j:]), f"duplicate [{i}, {j})"
    if op == "magic":
        magic = rng.choice(MAGICS)
        return magic + bytes(d[len(magic):]), f"magic {magic!r}"
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 2048))), "random bytes only"


def _fuzz(seeds: dict[str, bytes], decode, allowed: type[Exception], seed_base: int) -> None:
    names = sorted(seeds)
    failures, slow = [], []
    for k in range(NUM_MUTATIONS):
        name = names[k % len(names)]
        data, what = mutate(seeds[name], random.Random(seed_base + k))
        start = time.perf_counter()
        try:
            decode(data)
        except allowed:
            pass
        except Exception as e:  # noqa: BLE001 - what the test is looking for
            failures.append(f"{name}, seed {seed_base + k} ({what}): {type(e).__name__}: {e}")
        took_s = time.perf_counter() - start
        if took_s > CASE_TIME_BOUND_S:
            slow.append(f"{name}, seed {seed_base + k} ({what}): {took_s:.1f} s")
    assert not failures, "\n".join(failures)
    assert not slow, "\n".join(slow)


@pytest.mark.filterwarnings("ignore::UserWarning")   # PIL's notes on the corrupt TIFF tags it skips
def test_fuzzed_images_give_a_media_error_or_an_image():
    _fuzz(image_seeds(), lambda data: load_image(data, MediaLimits()), MediaError, seed_base=10_000)


def test_fuzzed_audio_gives_an_audio_error_or_audio():
    seeds = {name: (AUDIO_DIR / name).read_bytes() for name in AUDIO_SEEDS}
    _fuzz(seeds, lambda data: load_audio(data, AudioLimits()), AudioError, seed_base=20_000)


# ------------------------------------------------------------------------------------------
# Inputs made to hurt: refused from their headers, within bounded time and memory
# ------------------------------------------------------------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width_px: int, height_px: int, idat: bytes, bit_depth: int = 8, color_type: int = 2) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width_px, height_px, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


@functools.lru_cache(maxsize=None)
def hostile_images() -> dict[str, bytes]:
    small = Image.new("RGB", (16, 16), (1, 2, 3))
    gif = bytearray(_encode(small, "GIF"))
    gif[6:10] = struct.pack("<HH", 65535, 65535)                      # logical screen
    jpeg = bytearray(_encode(small, "JPEG"))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", 65500, 65500)           # frame height, width
    bmp = bytearray(_encode(small, "BMP"))
    bmp[18:26] = struct.pack("<ii", 100_000, 100_000)
    webp = bytearray(_encode(small, "WEBP", lossless=True))
    return {
        "PNG header claiming 100000x100000": png(100_000, 100_000, zlib.compress(b"\0" * 64)),
        # 20000 x 20000 1-bit zeros: ~50 kB that would decode to 400 MB (PIL keeps a byte per pixel)
        "PNG decompression bomb": png(20_000, 20_000, zlib.compress(b"\0" * 2501 * 20_000, 9), bit_depth=1,
                                      color_type=0),
        "GIF screen 65535x65535": bytes(gif),
        "JPEG frame 65500x65500": bytes(jpeg),
        "BMP 100000x100000": bytes(bmp),
        "WebP truncated": bytes(webp[:len(webp) // 2]),
        "PNG magic, JPEG body": b"\x89PNG" + _encode(small, "JPEG")[4:],
        "JPEG magic, then text": b"\xff\xd8" + b"not a jpeg at all" * 10,
        "PNG without IDAT": _encode(small, "PNG").split(b"IDAT")[0],
        "empty": b"",
    }


def wav_header(data_bytes: int, rate_hz: int = 16000, channels: int = 1, bits: int = 16) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, channels, rate_hz, rate_hz * channels * bits // 8, channels * bits // 8, bits)
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_bytes))


def flac_silence(seconds: int, rate_hz: int = 8000, declared_samples: int | None = None) -> bytes:
    """Silence as FLAC (a few bytes per 4096 samples); ``declared_samples`` overwrites STREAMINFO's total
    (0: unknown, as a stream written to a pipe: only counting while decoding finds the length)."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", samplerate=rate_hz, channels=1, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros(rate_hz * 10, np.int16)
        for _ in range(seconds // 10):
            f.write(block)
    data = bytearray(buf.getvalue())
    if declared_samples is not None:
        info = 8                                       # STREAMINFO, after "fLaC" and its block header
        data[info + 13] = (data[info + 13] & 0xF0) | (declared_samples >> 32 & 0x0F)
        data[info + 14:info + 18] = struct.pack(">I", declared_samples & 0xFFFFFFFF)
    return bytes(data)


def with_broken_mp4_sample_table(data: bytes) -> bytes:
    """``data`` (an MP4) whose first ``stts`` entry gives each sample a duration of 2^31 - 1 ticks."""
    d = bytearray(data)
    at = d.index(b"stts")
    d[at + 16:at + 20] = struct.pack(">I", 0x7FFFFFFF)
    return bytes(d)


AUDIO_LIMITS = AudioLimits(max_duration_s=60.0)


@functools.lru_cache(maxsize=None)
def hostile_audio() -> dict[str, bytes]:
    fox_m4a = (AUDIO_DIR / "fox.m4a").read_bytes()
    return {
        "WAV claiming 2 hours, 1 s of data": wav_header(2 * 3600 * 32000) + b"\0" * 32000,
        "WAV at 1 Hz": wav_header(32000, rate_hz=1) + b"\0" * 32000,
        "WAV with 0 channels": wav_header(32000, channels=0) + b"\0" * 32000,
        "WAV with 4096 channels": wav_header(32000 * 4096, channels=4096) + b"\0" * 32000,
        "FLAC declaring 2^36-1 samples": flac_silence(10, declared_samples=2**36 - 1),
        # ~40 kB that decode to 30 minutes: stopped at the 60 s limit while decoding, not after
        "FLAC bomb, length unknown": flac_silence(1800, declared_samples=0),
        "FLAC 30 min, declared": flac_silence(1800),
        "M4A with a broken sample table": with_broken_mp4_sample_table(fox_m4a),
        "M4A truncated": fox_m4a[:len(fox_m4a) // 3],
        "OGG magic, WAV body": b"OggS" + (AUDIO_DIR / "fox.wav").read_bytes()[4:],
        "random bytes": bytes(random.Random(0).randrange(256) for _ in range(4096)),
    }


@pytest.mark.parametrize("name", list(hostile_images()))
def test_hostile_images_are_refused_quickly(name):
    data = hostile_images()[name]
    start = time.perf_counter()
    with pytest.raises(MediaError):
        load_image(data, MediaLimits())
    assert time.perf_counter() - start < CASE_TIME_BOUND_S


@pytest.mark.parametrize("name", list(hostile_audio()))
def test_hostile_audio_is_refused_quickly(name):
    data = hostile_audio()[name]
    start = time.perf_counter()
    with pytest.raises(AudioError):
        load_audio(data, AUDIO_LIMITS)
    assert time.perf_counter() - start < CASE_TIME_BOUND_S


_MEMORY_PROBE = """
import json, resource, sys
sys.path[:0] = {paths!r}
from multimodal.audio import AudioError, load_audio
from multimodal.media import MediaError, MediaLimits, load_image
from tests.robustness.test_hostile_media import AUDIO_LIMITS, hostile_audio, hostile_images, image_seeds
images, audio = hostile_images(), hostile_audio()
load_image(image_seeds()["png"], MediaLimits())                    # codecs loaded: the baseline
load_audio(open({wav!r}, "rb").read(), AUDIO_LIMITS)
base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
peaks = {{}}
for name, data in images.items():
    try:
        load_image(data, MediaLimits())
    except MediaError:
        pass
    peaks[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb
for name, data in audio.items():
    try:
        load_audio(data, AUDIO_LIMITS)
    except AudioError:
        pass
    peaks[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb
print(json.dumps(peaks))
"""


def test_hostile_media_are_refused_before_they_take_memory():
    """In a fresh process (its peak RSS is this test's alone): after the codecs are loaded, none of the
    hostile inputs raises the peak by more than 64 MB, where decoding any bomb in full would take
    hundreds (the PNG bomb 400 MB, the FLAC bomb 115 MB at 16 kHz)."""
    root = Path(__file__).resolve().parents[2]
    code = _MEMORY_PROBE.format(paths=[str(root)], wav=str(AUDIO_DIR / "fox.wav"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    peaks_kb = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(peaks_kb.values()) < 64 * 1024, peaks_kb
