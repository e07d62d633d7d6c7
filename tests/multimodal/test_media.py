"""multimodal/media.py: every way to send an image, and every refusal with its user-facing message.
http(s) runs against a local server on 127.0.0.1; nothing leaves the machine."""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import time
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from multimodal.media import MediaError, MediaLimits, load_image


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    """Smooth gradients plus a little noise: JPEG keeps it close."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:24, 0:32]
    pixels = np.stack([x * 8, y * 10, (x + y) * 4], axis=-1) + rng.integers(0, 8, (24, 32, 3))
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.fixture(scope="module")
def png(picture) -> bytes:
    return encode(picture, "PNG")


@pytest.fixture(scope="module")
def jpeg(picture) -> bytes:
    return encode(picture, "JPEG", quality=90)


def png_header_only(width_px: int, height_px: int) -> bytes:
    """A PNG whose header claims ``width_px`` x ``height_px`` and whose pixel data is cut short."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# -- bytes, PIL images, decoding ---------------------------------------------------------------------


def test_png_and_jpeg_bytes(picture, png, jpeg):
    image = load_image(png)
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), np.asarray(picture))
    image = load_image(jpeg)
    assert image.size == picture.size and image.mode == "RGB"
    assert np.abs(np.asarray(image).astype(int) - np.asarray(picture)).mean() < 6   # lossy, but close


def test_pil_image_is_returned_after_checks(picture):
    assert load_image(picture) is picture
    with pytest.raises(MediaError, match=r"the image is empty \(0x5 px\)"):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(MediaError, match="32x24 px = 768 pixels, above the limit of 100"):
        load_image(picture, MediaLimits(max_image_pixels=100))


def test_not_an_image():
    with pytest.raises(MediaError, match="not an image in a supported format"):
        load_image(b"hello, this is text")
    with pytest.raises(MediaError, match=r"the image is empty \(0 bytes\)"):
        load_image(b"")


def test_unsupported_format_is_refused(picture):
    with pytest.raises(MediaError, match="not an image in a supported format .*PNG, JPEG"):
        load_image(encode(picture, "PPM"))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_fails_at_load(picture, fmt):
    data = encode(picture, fmt)
    Image.open(io.BytesIO(data[:len(data) * 9 // 10]))   # the header alone still reads
    with pytest.raises(MediaError, match="could not be decoded, it is truncated or corrupt"):
        load_image(data[:len(data) * 9 // 10])
    with pytest.raises(MediaError, match="truncated or corrupt"):
        load_image(data[:40])


def test_too_many_pixels_refused_before_decoding():
    # The pixel data is cut short: a decode would fail as "truncated", so this refusal came first.
    with pytest.raises(MediaError, match="20x20 px = 400 pixels, above the limit of 399"):
        load_image(png_header_only(20, 20), MediaLimits(max_image_pixels=399))
    with pytest.raises(MediaError, match="truncated or corrupt"):
        load_image(png_header_only(20, 20), MediaLimits(max_image_pixels=400))


def test_pil_decompression_bomb_error_is_a_media_error():
    limit = Image.MAX_IMAGE_PIXELS
    with pytest.raises(MediaError, match="too many pixels"):   # above twice PIL's limit: PIL raises
        load_image(png_header_only(20000, 20000), MediaLimits(max_image_pixels=10 ** 12))
    assert Image.MAX_IMAGE_PIXELS == limit


def test_pil_decompression_bomb_warning_is_a_media_error():
    bomb = png_header_only(10000, 10000)   # between PIL's limit and twice it: PIL warns
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(MediaError, match="too many pixels"):
            load_image(bomb, MediaLimits(max_image_pixels=10 ** 12))
    with pytest.warns(Image.DecompressionBombWarning):   # the warning only recorded: PIL's limit still holds
        with pytest.raises(MediaError, match=f"above the limit of {Image.MAX_IMAGE_PIXELS}"):
            load_image(bomb, MediaLimits(max_image_pixels=10 ** 12))


def test_too_large_bytes(png):
    with pytest.raises(MediaError, match=f"the image is {len(png)} bytes, above the limit of 100"):
        load_image(png, MediaLimits(max_image_bytes=100))


def test_exif_orientation_is_applied(picture):
    exif = Image.Exif()
    exif[0x0112] = 6   # rotate 90 degrees clockwise to display
    image = load_image(encode(picture, "JPEG", exif=exif.tobytes()))
    assert image.size == (24, 32)


def test_unsupported_source_type():
    with pytest.raises(MediaError, match="not int"):
        load_image(42)


# -- data URLs ---------------------------------------------------------------------------------------


def test_data_urls(picture, png, jpeg):
    assert np.array_equal(np.asarray(load_image(data_url(png))), np.asarray(picture))
    assert load_image(data_url(jpeg, "image/jpeg")).size == picture.size
    wrapped = data_url(png)[:60] + "\n" + data_url(png)[60:]   # line breaks inside the base64
    assert load_image(wrapped).size == picture.size


def test_bad_data_urls(png):
    with pytest.raises(MediaError, match="not valid base64"):
        load_image("data:image/png;base64,abc$%^")
    with pytest.raises(MediaError, match="must hold an image"):
        load_image(data_url(png, "text/html"))
    with pytest.raises(MediaError, match="must be base64-encoded"):
        load_image("data:image/png,rawbytes")
    with pytest.raises(MediaError, match="malformed data URL"):
        load_image("data:image/png;base64")
    with pytest.raises(MediaError, match="above the limit of 100"):
        load_image(data_url(png), MediaLimits(max_image_bytes=100))
    with pytest.raises(MediaError, match="not an image"):
        load_image(data_url(b"plain text, not a picture"))


@pytest.mark.parametrize("url", ["ftp://example.com/cat.png", "javascript:alert(1)", "gopher://x/1",
                                 "cat.png", "/etc/passwd", "mailto:a@b.c"])
def test_unsupported_schemes(url):
    with pytest.raises(MediaError, match="unsupported image URL .*use an http\\(s\\):// URL"):
        load_image(url)


# -- local files -------------------------------------------------------------------------------------


@pytest.fixture
def media_dirs(tmp_path, png):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "cat.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    return allowed, outside


def test_file_urls_inside_the_allowed_dir(media_dirs):
    allowed, _ = media_dirs
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image((allowed / "sub" / "cat.png").as_uri(), limits).size == (32, 24)
    os.symlink(allowed / "sub" / "cat.png", allowed / "link.png")   # a link that stays inside
    assert load_image((allowed / "link.png").as_uri(), limits).size == (32, 24)


def test_file_urls_refused(media_dirs):
    allowed, outside = media_dirs
    url = (allowed / "sub" / "cat.png").as_uri()
    with pytest.raises(MediaError, match="file:// URLs are not enabled on this server"):
        load_image(url)
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="outside the allowed media directory"):
        load_image((outside / "secret.png").as_uri(), limits)
    with pytest.raises(MediaError, match="outside the allowed media directory"):
        load_image(f"file://{allowed}/sub/../../outside/secret.png", limits)
    os.symlink(outside / "secret.png", allowed / "escape.png")
    with pytest.raises(MediaError, match="outside the allowed media directory"):
        load_image((allowed / "escape.png").as_uri(), limits)
    os.symlink(outside, allowed / "escape_dir")
    with pytest.raises(MediaError, match="outside the allowed media directory"):
        load_image((allowed / "escape_dir" / "secret.png").as_uri(), limits)
    with pytest.raises(MediaError, match="image file not found: file://.*/missing.png"):
        load_image((allowed / "missing.png").as_uri(), limits)
    with pytest.raises(MediaError, match="is a directory"):
        load_image((allowed / "sub").as_uri(), limits)
    with pytest.raises(MediaError, match="names host 'example.com'"):
        load_image(f"file://example.com{allowed}/sub/cat.png", limits)
    os.mkfifo(allowed / "pipe.png")
    with pytest.raises(MediaError, match="is not a regular file"):
        load_image((allowed / "pipe.png").as_uri(), limits)
    with pytest.raises(MediaError, match="above the limit of 10"):
        load_image(url, MediaLimits(allowed_local_media_path=str(allowed), max_image_bytes=10))


def test_plain_paths_only_when_allowed(media_dirs):
    allowed, _ = media_dirs
    path = allowed / "sub" / "cat.png"
    assert load_image(str(path), allow_local_paths=True).size == (32, 24)
    assert load_image(path, allow_local_paths=True).size == (32, 24)
    with pytest.raises(MediaError, match="local file paths are not accepted here"):
        load_image(path)
    with pytest.raises(MediaError, match="unsupported image URL"):
        load_image(str(path))
    with pytest.raises(MediaError, match="image file not found: .*nope.png"):
        load_image(str(allowed / "nope.png"), allow_local_paths=True)


# -- http(s) -----------------------------------------------------------------------------------------


LOCAL = MediaLimits(allow_private_media_urls=True)
"""The test server is on 127.0.0.1, which media URLs may not reach by default (SSRF)."""


class Handler(BaseHTTPRequestHandler):
    png = b""

    def log_message(self, *args) -> None:   # quiet
        pass

    def send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        try:
            self.route(self.path)
        except (BrokenPipeError, ConnectionResetError):   # the client gave up (the timeout tests)
            pass

    def route(self, path: str) -> None:
        if path == "/cat.png":
            self.send(200, self.png, {"Content-Type": "image/png"})
        elif path == "/redirect":
            self.send(302, headers={"Location": "/cat.png"})
        elif path == "/loop":
            self.send(302, headers={"Location": "/loop"})
        elif path.startswith("/chain/"):   # /chain/N redirects N more times
            n = int(path.rsplit("/", 1)[1])
            self.send(302, headers={"Location": f"/chain/{n - 1}" if n > 0 else "/cat.png"})
        elif path == "/to-ftp":
            self.send(302, headers={"Location": "ftp://127.0.0.1/cat.png"})
        elif path == "/slow":
            time.sleep(3)
            self.send(200, self.png)
        elif path == "/drip":   # each byte within the read timeout, the whole past the deadline
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/big":
            self.send(200, b"\0" * 5000)
        elif path == "/big-unannounced":   # no Content-Length: the body is read until the limit
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"\0" * 5000)
        elif path == "/text":
            self.send(200, b"<html>not an image</html>", {"Content-Type": "text/html"})
        else:
            self.send(404, b"not found")


@pytest.fixture(scope="module")
def server(png):
    Handler.png = png
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_http_fetch(server, picture):
    assert np.array_equal(np.asarray(load_image(f"{server}/cat.png", LOCAL)), np.asarray(picture))
    assert load_image(f"{server}/redirect", LOCAL).size == picture.size
    limits = MediaLimits(max_redirects=5, allow_private_media_urls=True)
    assert load_image(f"{server}/chain/4", limits).size == picture.size


def test_http_errors(server):
    with pytest.raises(MediaError, match=r"fetching .*/missing failed: HTTP 404"):
        load_image(f"{server}/missing", LOCAL)
    with pytest.raises(MediaError, match="too many redirects .* or a redirect loop"):
        load_image(f"{server}/loop", LOCAL)
    with pytest.raises(MediaError, match=r"too many redirects \(more than 2\)"):
        load_image(f"{server}/chain/3", MediaLimits(max_redirects=2, allow_private_media_urls=True))
    with pytest.raises(MediaError, match="redirects to a ftp: URL, which is not allowed"):
        load_image(f"{server}/to-ftp", LOCAL)
    with pytest.raises(MediaError, match="not an image"):
        load_image(f"{server}/text", LOCAL)


def test_http_too_large(server):
    limits = MediaLimits(max_image_bytes=1000, allow_private_media_urls=True)
    with pytest.raises(MediaError, match="is 5000 bytes, above the limit of 1000"):
        load_image(f"{server}/big", limits)
    with pytest.raises(MediaError, match="larger than the limit of 1000 bytes"):
        load_image(f"{server}/big-unannounced", limits)


def test_http_timeouts(server):
    limits = MediaLimits(fetch_timeout_s=0.5, allow_private_media_urls=True)
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        load_image(f"{server}/slow", limits)
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        load_image(f"{server}/drip", limits)
    assert time.monotonic() - start < 2.5


def test_connection_refused():
    with pytest.raises(MediaError, match="fetching http://127.0.0.1:1/x.png failed"):
        load_image("http://127.0.0.1:1/x.png", LOCAL)


def test_error_is_a_value_error():
    assert issubclass(MediaError, ValueError)
    with pytest.raises(ValueError):
        load_image("ftp://x")


def test_path_type_hint_covers_pathlike(tmp_path, png):
    (tmp_path / "a.png").write_bytes(png)
    assert load_image(Path(tmp_path / "a.png"), allow_local_paths=True).size == (32, 24)
