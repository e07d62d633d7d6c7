"""Image URLs cannot make the server fetch from its own network (``multimodal/media.py``).

Every connection of a download (the first and each redirect hop) resolves its host once, refuses it
if any address is non-public (loopback, private, link-local, multicast, reserved, unspecified,
shared, IPv4 embedded in IPv6; decimal and octal host forms), and connects to the address it checked
(DNS rebinding cannot swap it). A refusal says "not allowed" and never names the address the host
resolved to (that goes to the server's log). ``allowed_media_domains`` restricts hosts and trusts them;
``allow_private_media_urls`` opens non-public addresses. file:// URLs stay under the allowed directory.
"""

from __future__ import annotations

import io
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from multimodal import media
from multimodal.media import MediaError, MediaLimits, check_address, load_image
from tests.multimodal.test_media import media_dirs, picture, png  # noqa: F401 - fixtures


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


class _Handler(BaseHTTPRequestHandler):
    hits: list[str] = []
    port = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        _Handler.hits.append(self.path)
        if self.path.startswith("/to/"):          # /to/<host>: redirect to the same path on another host
            self.send_response(302)
            self.send_header("Location", f"http://{self.path[4:]}:{_Handler.port}/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/again":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)


@pytest.fixture(scope="module")
def port():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    _Handler.port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def fresh_hits():
    _Handler.hits = []


@pytest.mark.parametrize("host, kind", [
    ("127.0.0.1", "loopback"),
    ("localhost", "loopback"),
    ("2130706433", "loopback"),        # 127.0.0.1 as one decimal number
    ("0177.0.0.1", "loopback"),        # octal
    ("0x7f.1", "loopback"),            # hex, short form
    ("127.1", "loopback"),
    ("[::1]", "loopback"),
    ("[::ffff:127.0.0.1]", "loopback"),   # IPv4-mapped IPv6
    ("0.0.0.0", "unspecified"),        # reaches this host on Linux
])
def test_loopback_in_every_spelling_is_refused_before_any_request(port, host, kind, caplog):
    with caplog.at_level("INFO", logger="chorus.media"):
        with pytest.raises(MediaError, match="host is not allowed: media URLs must point to public addresses") as e:
            load_image(f"http://{host}:{port}/cat.png")
    assert _Handler.hits == []
    assert_no_address(str(e.value))
    assert f"a {kind} address" in caplog.text   # the operator's log says what it was


def assert_no_address(message: str) -> None:
    """The error names no address the host resolved to (the server's network stays unknown)."""
    for address in ("127.0.0.1", "::1", "0.0.0.0", "10.", "192.168.", "172.16.", "169.254.", "fd00", "fe80",
                    "loopback", "private", "link-local", "resolves to"):
        assert address not in message, message


@pytest.mark.parametrize("address, kind", [
    ("10.1.2.3", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),                 # cloud metadata services
    ("100.64.0.1", "not globally routable"),           # carrier-grade NAT
    ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"), ("0.0.0.0", "unspecified"),
    ("fd00::1", "private"), ("fe80::1", "link-local"), ("ff02::1", "multicast"), ("::", "unspecified"),
    ("::ffff:10.0.0.1", "private"), ("2002:a00:1::1", "private"),   # IPv4 mapped / 6to4
    ("64:ff9b::a9fe:a9fe", "link-local"),              # NAT64 of 169.254.169.254
])
def test_every_non_public_range_is_refused(address, kind, caplog):
    with caplog.at_level("INFO", logger="chorus.media"):
        with pytest.raises(MediaError, match="is not allowed") as e:
            check_address(address)
    assert address not in str(e.value) and kind not in str(e.value)
    assert f"{address}, a {kind} address" in caplog.text


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address):
    check_address(address)


def _fake_dns(monkeypatch, answers: dict[str, list]) -> list[str]:
    """``socket.getaddrinfo`` answering ``answers[host]`` (a list per call: each call takes the next,
    the last repeats); returns the hosts asked, in order."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        asked.append(host)
        addresses = answers[host][min(len(asked) - 1, len(answers[host]) - 1)]
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


def test_a_host_with_one_private_address_among_public_ones_is_refused(port, monkeypatch):
    _fake_dns(monkeypatch, {"mixed.test": [["93.184.216.34", "127.0.0.1"]]})
    with pytest.raises(MediaError, match="host is not allowed") as e:
        load_image(f"http://mixed.test:{port}/cat.png")
    assert _Handler.hits == []
    assert_no_address(str(e.value))
    assert "93.184.216.34" not in str(e.value)


def test_dns_rebinding_cannot_swap_the_checked_address(port, monkeypatch):
    """The host resolves to a public address when checked and to 127.0.0.1 afterwards: the download
    connects to the checked address (unreachable here), never to the local server."""
    asked = _fake_dns(monkeypatch, {"rebind.test": [["93.184.216.34"], ["127.0.0.1"]]})
    with pytest.raises(MediaError, match="fetching http://rebind.test"):
        load_image(f"http://rebind.test:{port}/cat.png", MediaLimits(fetch_timeout_s=1.0))
    assert asked == ["rebind.test"] and _Handler.hits == []


def test_every_redirect_hop_is_checked_again(port, monkeypatch):
    checked = []
    real_check = media.check_address

    def first_hop_only(address: str) -> None:   # as if the first hop's host had been public
        checked.append(address)
        if len(checked) > 1:
            real_check(address)

    monkeypatch.setattr(media, "check_address", first_hop_only)
    with pytest.raises(MediaError, match="host is not allowed"):
        load_image(f"http://127.0.0.1:{port}/again")
    assert _Handler.hits == ["/again"] and checked == ["127.0.0.1", "127.0.0.1"]


def test_allowed_media_domains_trust_only_the_hosts_they_name(port):
    trusted = MediaLimits(allowed_media_domains=("127.0.0.1",))
    assert load_image(f"http://127.0.0.1:{port}/cat.png", trusted).size == (8, 6)
    assert load_image(f"http://127.0.0.1:{port}/again", trusted).size == (8, 6)   # same host: allowed
    with pytest.raises(MediaError, match="host 'localhost' is not an allowed media domain"):
        load_image(f"http://127.0.0.1:{port}/to/localhost", trusted)              # a hop elsewhere
    with pytest.raises(MediaError, match="host '127.0.0.1' is not an allowed media domain"):
        load_image(f"http://127.0.0.1:{port}/cat.png", MediaLimits(allowed_media_domains=("images.example",)))
    assert load_image(f"http://LocalHost:{port}/cat.png",
                      MediaLimits(allowed_media_domains=("localhost.",))).size == (8, 6)   # case, trailing dot


def test_allow_private_media_urls_opens_the_local_network(port):
    opened = MediaLimits(allow_private_media_urls=True)
    assert load_image(f"http://localhost:{port}/cat.png", opened).size == (8, 6)
    assert load_image(f"http://127.0.0.1:{port}/to/localhost", opened).size == (8, 6)


def test_proxies_from_the_environment_are_not_used(port, monkeypatch):
    """A proxy would resolve and connect by itself, past the address check."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    assert load_image(f"http://127.0.0.1:{port}/cat.png", MediaLimits(allow_private_media_urls=True)).size == (8, 6)


def test_unresolvable_host_is_a_media_error(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(MediaError, match="host 'nowhere.test' could not be resolved"):
        load_image("http://nowhere.test/cat.png")


# -- file:// ---------------------------------------------------------------------------------------------

def test_file_urls_resolve_symlinks_and_dotdot_before_the_check(media_dirs, tmp_path):
    allowed, outside = media_dirs
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    os.symlink(outside / "secret.png", allowed / "sub" / "link.png")           # a link pointing outside
    os.symlink(outside, allowed / "sub" / "door")                               # a directory link outside
    for url in [(allowed / "sub" / "link.png").as_uri(), (allowed / "sub" / "door" / "secret.png").as_uri(),
                f"file://{allowed}/sub/../../outside/secret.png",
                f"file://{allowed}/sub/%2e%2e/%2e%2e/outside/secret.png",       # percent-encoded ..
                f"file://{allowed}/sub/door/../../../outside/secret.png"]:
        with pytest.raises(MediaError, match="outside the allowed media directory"):
            load_image(url, limits)
    assert load_image(f"file://{allowed}/sub/../sub/cat.png", limits).size == (32, 24)   # .. that stays inside
    # The allowed directory given through a symlink: what lies under its target is inside.
    os.symlink(allowed, tmp_path / "alias")
    assert load_image((allowed / "sub" / "cat.png").as_uri(),
                      MediaLimits(allowed_local_media_path=str(tmp_path / "alias"))).size == (32, 24)


def test_serve_flags_reach_the_media_limits(tiny_llama_dir):
    import argparse
    from types import SimpleNamespace

    from engine.arg_utils import EngineArgs
    from engine.processor import Processor
    from engine.server.args import add_serve_args, engine_kwargs

    def limits(*flags: str) -> MediaLimits:
        args = add_serve_args(argparse.ArgumentParser()).parse_args([str(tiny_llama_dir), *flags])
        config = EngineArgs.from_kwargs(**engine_kwargs(args)).create_engine_config()
        return Processor.media_limits.fget(SimpleNamespace(mm_config=config.mm_config))

    default = limits()
    assert default.allowed_media_domains is None and not default.allow_private_media_urls
    opened = limits("--allowed-media-domains", "img.example", "127.0.0.1", "--allow-private-media-urls")
    assert opened.allowed_media_domains == ("img.example", "127.0.0.1") and opened.allow_private_media_urls
