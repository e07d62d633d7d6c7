"""Loading user images safely: PIL images, bytes, data URLs, http(s) URLs, file:// URLs and local paths.

Every source ends in one decoder that refuses what a server must not take: formats outside a short
list of web image formats (PIL would otherwise try every plugin it has), more pixels than
``MediaLimits.max_image_pixels`` (checked from the header, before decoding), empty images, and files
that fail to decode in full (the image is ``load()``-ed here, so a truncated file fails now, not later
in a worker). Downloads, data URLs and files are read up to ``max_image_bytes`` and no further; file://
URLs are confined to ``allowed_local_media_path`` after resolving symlinks and ``..``. Every refusal is
a ``MediaError`` whose message can go back to the user as it is.

``load_image`` does it all at once; a caller that budgets decoding first reads the encoded bytes
(``read_image_source``), opens each header (``open_image``: format and size, nothing decoded), then
decodes (``finish_decode``).

http(s) downloads cannot reach the server's own network (SSRF): before every connection (the first
and each redirect hop) the host is resolved once with ``getaddrinfo`` and every address it resolves to
must be public (not loopback, private, link-local, multicast, reserved, unspecified or shared, IPv4 or
IPv6, an IPv4 address mapped or embedded in IPv6 included; decimal and octal host forms resolve to
what they mean); the socket then connects to the checked address, so DNS rebinding cannot swap it.
``MediaLimits.allowed_media_domains`` restricts the hosts (trusting their addresses, private ones
too), ``allow_private_media_urls`` lifts the address check (tests, a trusted local network). A refused
address is named in the server's log only, never in the error the client gets.
Downloads connect directly: proxies from the environment are not used.

Audio URLs (``read_audio_source``: ``data:audio/...``, http(s), file://) are read by the same functions under
the same guards, bounded by the audio byte limit; ``multimodal.audio`` decodes them.

EXIF orientation is applied to decoded files (a phone photo comes out upright, as transformers'
``load_image`` does); PIL images given directly are returned as they are.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import http.client
import importlib
import io
import ipaddress
import logging
import os
import re
import socket
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from PIL import Image, ImageOps

for _plugin in ("Png", "Jpeg", "Gif", "WebP", "Bmp", "Tiff", "Avif"):
    try:
        importlib.import_module(f"PIL.{_plugin}ImagePlugin")
    except ImportError:   # a Pillow built without that codec
        pass
ALLOWED_FORMATS = tuple(f for f in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "AVIF") if f in Image.OPEN)
"""Formats a user image may be in (JPEG includes MPO); PIL's other plugins (EPS, PSD, ...) are not
offered untrusted bytes."""
MAGIC_NUMBERS = ((b"\x89PNG", "PNG"), (b"\xff\xd8", "JPEG"), (b"GIF8", "GIF"), (b"RIFF", "WEBP"),
                 (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
"""How a file of each allowed format starts: names what a file that fails to open was meant to be."""
READ_CHUNK_BYTES = 1 << 16
DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)$", re.DOTALL)
WHITESPACE = re.compile(r"\s+")
SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
URL_SAFE_TO_STANDARD = str.maketrans("-_", "+/")

logger = logging.getLogger("chorus.media")

ImageSource = Union[Image.Image, bytes, bytearray, memoryview, str, os.PathLike]


class MediaError(ValueError):
    """An image could not be loaded; the message says why, for the user (an HTTP 400 body)."""


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be and where they may come from."""

    allowed_local_media_path: Optional[str] = None
    """file:// URLs are served only from under this directory (symlinks and ``..`` resolved first);
    None: file:// URLs are refused."""
    fetch_timeout_s: float = 10.0
    """http(s): the connect timeout, each read's timeout, and the limit on the whole download."""
    max_image_bytes: int = 20 << 20
    """Largest download, data URL payload, file or bytes object, in bytes."""
    max_redirects: int = 5
    """http(s) redirects followed before giving up."""
    max_image_pixels: int = 50_000_000
    """Largest width * height, checked from the header before decoding (decompression bombs)."""
    allowed_media_domains: Optional[tuple[str, ...]] = None
    """http(s) URLs (and every redirect) may only name these hosts, compared case-insensitively and
    exactly (vLLM's ``--allowed-media-domains``); their addresses are trusted, private ones too.
    None: any host whose addresses are all public."""
    allow_private_media_urls: bool = False
    """Let http(s) URLs reach non-public addresses (loopback, private, link-local, ...): tests and
    trusted local networks only."""


def load_image(source: ImageSource, limits: MediaLimits = MediaLimits(),
               allow_local_paths: bool = False) -> Image.Image:
    """A fully decoded PIL image from ``source``: a PIL image, encoded bytes, a ``data:image/...;base64,``
    URL, an ``http(s)://`` URL, a ``file://`` URL (under ``limits.allowed_local_media_path``) or, with
    ``allow_local_paths`` (the offline API), a filesystem path. Raises ``MediaError``."""
    data = read_image_source(source, limits, allow_local_paths)
    if isinstance(data, Image.Image):
        return checked_image(data, limits)
    return finish_decode(open_image(data, limits))


def read_image_source(source: ImageSource, limits: MediaLimits = MediaLimits(),
                      allow_local_paths: bool = False) -> Union[bytes, Image.Image]:
    """The encoded bytes ``source`` names (fetched, read or unpacked from a data URL, at most
    ``max_image_bytes``), or the PIL image it is. Nothing is decoded. Raises ``MediaError``."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > limits.max_image_bytes:
            raise MediaError(f"the image is {len(data)} bytes, above the limit of {limits.max_image_bytes}")
        return data
    if isinstance(source, os.PathLike):
        if not allow_local_paths:
            raise MediaError("local file paths are not accepted here; send the image as a data URL or an "
                             "http(s) URL")
        return read_local_file(Path(source), str(source), limits)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a URL, a data URL, bytes or a PIL image, not {type(source).__name__}")
    match = SCHEME.match(source[:64])
    scheme = match[1].lower() if match else ""
    if scheme == "data":
        return decode_data_url(source, limits)
    if scheme in ("http", "https"):
        return fetch_url(source, limits)
    if scheme == "file":
        return read_local_file(file_url_path(source, limits), source, limits)
    if allow_local_paths and (not scheme or len(scheme) == 1):   # a plain path (or a Windows drive letter)
        return read_local_file(Path(source), source, limits)
    shown = source if len(source) <= 80 else source[:77] + "..."
    raise MediaError(f"unsupported image URL {shown!r}: use an http(s):// URL or a data:image/...;base64, URL"
                     + (" (or a file:// URL under the allowed media directory)"
                        if limits.allowed_local_media_path else ""))


def checked_image(image: Image.Image, limits: MediaLimits) -> Image.Image:
    """``image`` after the size checks, fully loaded."""
    check_size(image.width, image.height, limits)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image could not be decoded, it is truncated or corrupt ({e})") from e
    return image


def check_size(width_px: int, height_px: int, limits: MediaLimits) -> None:
    if width_px <= 0 or height_px <= 0:
        raise MediaError(f"the image is empty ({width_px}x{height_px} px)")
    max_pixels = limits.max_image_pixels
    if Image.MAX_IMAGE_PIXELS is not None:   # PIL's own bomb limit, where it is lower, refuses too
        max_pixels = min(max_pixels, Image.MAX_IMAGE_PIXELS)
    if width_px * height_px > max_pixels:
        raise MediaError(f"the image is {width_px}x{height_px} px = {width_px * height_px} pixels, above the "
                         f"limit of {max_pixels}; send a smaller image")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode encoded image bytes in full, refusing unknown formats and oversized or broken images."""
    return finish_decode(open_image(data, limits))


def open_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """An image opened from its header only (format and size known and checked, pixels not decoded):
    ``image.width * image.height`` is what decoding it will cost. ``finish_decode`` decodes it."""
    if not data:
        raise MediaError("the image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"the image has too many pixels ({e})") from e
    except Image.UnidentifiedImageError as e:
        kind = next((name for magic, name in MAGIC_NUMBERS if data.startswith(magic)), None)
        if kind is not None:
            raise MediaError(f"the data starts like a {kind} image but could not be read, it is truncated or "
                             f"corrupt") from e
        raise MediaError(f"the data is not an image in a supported format ({', '.join(ALLOWED_FORMATS)})") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"the image could not be read, it is truncated or corrupt ({e})") from e
    check_size(image.width, image.height, limits)
    return image


def finish_decode(image: Image.Image) -> Image.Image:
    """Decode an ``open_image`` image in full and apply its EXIF orientation."""
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image could not be decoded, it is truncated or corrupt ({e})") from e
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"the image's EXIF orientation could not be applied ({e})") from e
    return image


def decode_data_url(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """The payload of a ``data:<kind>/...;base64,`` URL (``kind``: "image", or "audio"), at most
    ``limits.max_image_bytes``."""
    match = DATA_URL.match(url)
    if match is None:
        raise MediaError(f"malformed data URL: expected data:{kind}/<type>;base64,<data>")
    media_type = match["type"].strip().lower()
    if not media_type.startswith(f"{kind}/"):
        raise MediaError(f"a data URL must hold {'an image' if kind == 'image' else kind} (data:{kind}/...), got "
                         f"{media_type or 'no media type'!r}")
    if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
        raise MediaError(f"a data URL {kind} must be base64-encoded (data:{kind}/...;base64,...)")
    # Tolerated: percent-encoding, line breaks, the URL-safe alphabet.
    payload = WHITESPACE.sub("", urllib.parse.unquote(match["data"])).translate(URL_SAFE_TO_STANDARD)
    if len(payload) * 3 // 4 > limits.max_image_bytes + 2:
        raise MediaError(f"the data URL {kind} is about {len(payload) * 3 // 4} bytes, above the limit of "
                         f"{limits.max_image_bytes}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL is not valid base64 ({e})") from e
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"the data URL {kind} is {len(data)} bytes, above the limit of {limits.max_image_bytes}")
    return data


class LimitedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows at most ``max_redirections`` redirects, and only to http(s) URLs."""

    def __init__(self, max_redirects: int):
        super().__init__()
        self.max_redirections = max_redirects

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            raise MediaError(f"the media URL redirects to a {scheme or 'relative'}: URL, which is not allowed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _disallowed_kind(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Optional[str]:
    """What kind of non-public address ``address`` is (None: a public one)."""
    for kind in ("loopback", "unspecified", "link_local", "multicast", "reserved", "private"):   # most specific first
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if address.is_global else "not globally routable"


def _embedded_ipv4(address: ipaddress.IPv6Address) -> Optional[ipaddress.IPv4Address]:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64 64:ff9b::/96), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def check_address(address: str) -> None:
    """Raise ``MediaError`` unless ``address`` (an IP literal) is public, with any IPv4 address it embeds."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])    # an IPv6 zone id ("fe80::1%eth0") dropped
    embedded = _embedded_ipv4(ip) if ip.version == 6 else None
    kind = _disallowed_kind(embedded or ip)                  # an embedded IPv4 address is where it goes
    if kind:
        # The address and its kind go to the operator's log only: the client learns nothing of the
        # server's network (which internal address a name resolves to).
        logger.info("Refused a media URL: its host resolves to %s, a %s address.", address, kind)
        raise MediaError("the media URL's host is not allowed: media URLs must point to public addresses")


class _AddressGuard:
    """Resolves a host once, checks every address, connects to a checked one: the TCP connect of every
    connection (each redirect hop) of a media download."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self.allowed_hosts = ({h.strip().lower().rstrip(".") for h in limits.allowed_media_domains}
                              if limits.allowed_media_domains is not None else None)

    def attach(self, connection: http.client.HTTPConnection) -> http.client.HTTPConnection:
        """``connection`` with its TCP connect (http.client's ``_create_connection`` hook) through here."""
        connection._create_connection = self.create_connection
        return connection

    def create_connection(self, address: tuple[str, int], timeout: Optional[float] = None,
                          source_address=None) -> socket.socket:
        """``socket.create_connection`` to a checked address of ``address``'s host."""
        host, port = address
        name = host.lower().rstrip(".")
        if self.allowed_hosts is not None and name not in self.allowed_hosts:
            raise MediaError(f"the media URL's host {host!r} is not an allowed media domain (allowed: "
                             f"{', '.join(sorted(self.allowed_hosts)) or 'none'})")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise MediaError(f"the media URL's host {host!r} could not be resolved ({e})") from e
        if self.allowed_hosts is None and not self.limits.allow_private_media_urls:
            for *_, sockaddr in infos:
                check_address(sockaddr[0])
        error: Optional[OSError] = None
        for family, kind, proto, _, sockaddr in infos:   # each address, as socket.create_connection does
            sock = socket.socket(family, kind, proto)
            try:
                if timeout is not None:
                    sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                return sock
            except OSError as e:
                sock.close()
                error = e
        raise error or OSError(f"no address for {host!r}")


class _GuardedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, guard: _AddressGuard) -> None:
        super().__init__()
        self._guard = guard

    def http_open(self, req):
        return self.do_open(lambda host, **kw: self._guard.attach(http.client.HTTPConnection(host, **kw)), req)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    """HTTPS over a checked address; TLS still verifies the certificate against the URL's host name."""

    def __init__(self, guard: _AddressGuard) -> None:
        super().__init__()
        self._guard = guard

    def https_open(self, req):
        return self.do_open(lambda host, **kw: self._guard.attach(http.client.HTTPSConnection(host, **kw)), req,
                            context=self._context)


def build_media_opener(limits: MediaLimits) -> urllib.request.OpenerDirector:
    """The opener media downloads use: no proxies, checked addresses on every hop, limited redirects."""
    guard = _AddressGuard(limits)
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _GuardedHTTPHandler(guard),
                                       _GuardedHTTPSHandler(guard), LimitedRedirects(limits.max_redirects))


def fetch_url(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """GET an http(s) URL of an ``kind`` ("image", "audio"): status 200, at most ``max_image_bytes``, within
    ``fetch_timeout_s``, from a public address (or an allowed host) on every hop."""
    shown = url if len(url) <= 200 else url[:197] + "..."
    opener = build_media_opener(limits)
    request = urllib.request.Request(url, headers={"User-Agent": "chorus-media/1", "Accept": f"{kind}/*"})
    deadline = time.monotonic() + limits.fetch_timeout_s
    try:
        with opener.open(request, timeout=limits.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
                raise MediaError(f"the {kind} at {shown} is {length} bytes, above the limit of "
                                 f"{limits.max_image_bytes}")
            chunks, size = [], 0
            while size <= limits.max_image_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError("download deadline")
                chunk = response.read1(min(READ_CHUNK_BYTES, limits.max_image_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        if str(e.reason).startswith(LimitedRedirects.inf_msg):
            raise MediaError(f"fetching {shown} failed: too many redirects (more than {limits.max_redirects}) "
                             f"or a redirect loop") from e
        raise MediaError(f"fetching {shown} failed: HTTP {e.code} {e.reason}") from e
    except TimeoutError as e:
        raise MediaError(f"fetching {shown} timed out after {limits.fetch_timeout_s:g} s") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise MediaError(f"fetching {shown} timed out after {limits.fetch_timeout_s:g} s") from e
        raise MediaError(f"fetching {shown} failed: {e.reason}") from e
    except (OSError, ValueError, http.client.HTTPException) as e:   # bad status line, cut body, bad URL
        raise MediaError(f"fetching {shown} failed: {e}") from e
    if size > limits.max_image_bytes:
        raise MediaError(f"the {kind} at {shown} is larger than the limit of {limits.max_image_bytes} bytes")
    return b"".join(chunks)


def file_url_path(url: str, limits: MediaLimits) -> Path:
    """The real path of a ``file://`` URL, which must lie under ``allowed_local_media_path``."""
    if limits.allowed_local_media_path is None:
        raise MediaError("file:// URLs are not enabled on this server; send the image as a data URL or an "
                         "http(s) URL")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL {url!r} names host {parts.netloc!r}; only local files are allowed")
    path = Path(urllib.request.url2pathname(parts.path))
    allowed = Path(limits.allowed_local_media_path).resolve()
    real = path.resolve()
    if not path.is_absolute() or not real.is_relative_to(allowed):
        raise MediaError(f"file:// URL {url!r} is outside the allowed media directory")
    return real


def read_local_file(path: Path, shown: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """The bytes of a regular local file, at most ``max_image_bytes``; ``shown`` names it in errors, ``kind``
    ("image", "audio") says what it should be."""
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise MediaError(f"{shown} is a directory, not {'an' if kind == 'image' else 'a'} {kind} file")
        if not stat.S_ISREG(info.st_mode):   # a FIFO or a device would block or never end
            raise MediaError(f"{shown} is not a regular file")
        if info.st_size > limits.max_image_bytes:
            raise MediaError(f"the {kind} file {shown} is {info.st_size} bytes, above the limit of "
                             f"{limits.max_image_bytes}")
        with open(path, "rb") as f:
            data = f.read(limits.max_image_bytes + 1)
    except FileNotFoundError as e:
        raise MediaError(f"{kind} file not found: {shown}") from e
    except PermissionError as e:
        raise MediaError(f"{kind} file {shown} cannot be read (permission denied)") from e
    except OSError as e:
        raise MediaError(f"{kind} file {shown} cannot be read ({e.strerror})") from e
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"the {kind} file {shown} is larger than the limit of {limits.max_image_bytes} bytes")
    return data


def read_audio_source(url: str, limits: MediaLimits, max_audio_bytes: int) -> bytes:
    """The encoded bytes of an audio URL, read as an image URL is and under the same guards: a
    ``data:audio/...;base64,`` URL, an ``http(s)://`` URL (public addresses or allowed hosts only, on every
    hop) or a ``file://`` URL under ``limits.allowed_local_media_path``; at most ``max_audio_bytes``.
    Nothing is decoded. Raises ``MediaError``."""
    limits = dataclasses.replace(limits, max_image_bytes=max_audio_bytes)
    match = SCHEME.match(url[:64])
    scheme = match[1].lower() if match else ""
    if scheme == "data":
        return decode_data_url(url, limits, kind="audio")
    if scheme in ("http", "https"):
        return fetch_url(url, limits, kind="audio")
    if scheme == "file":
        return read_local_file(file_url_path(url, limits), url, limits, kind="audio")
    shown = url if len(url) <= 80 else url[:77] + "..."
    raise MediaError(f"unsupported audio URL {shown!r}: use an http(s):// URL or a data:audio/...;base64, URL"
                     + (" (or a file:// URL under the allowed media directory)"
                        if limits.allowed_local_media_path else ""))
