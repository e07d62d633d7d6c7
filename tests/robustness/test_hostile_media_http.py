"""Hostile media over HTTP: image URLs into the server's own network and hostile image bytes on a
(tiny random) LLaVA server, hostile audio uploads on a Whisper server: each is a 400 with OpenAI's
error body within a few seconds, and the server goes on serving."""

from __future__ import annotations

import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.audio.whisper_reference import whisper_dir
from tests.robustness.test_hostile_media import AUDIO_DIR, hostile_audio, hostile_images
from tests.server.conftest import start_server
from tests.vision.conftest import build_tiny_llava, make_image

TIME_BOUND_S = 10.0
"""Per request, the server's processing of a refused input included (typically well under a second)."""


def _png(image) -> bytes:
    import io
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(server, url: str) -> httpx.Response:
    body = {"model": "llava", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def _assert_400(response: httpx.Response, started_s: float, match: str = "") -> None:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and match in err["message"]
    assert time.perf_counter() - started_s < TIME_BOUND_S


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    srv = start_server(str(build_tiny_llava(tmp_path_factory.mktemp("llava"))), served_model_name=["llava"],
                       dtype="float32", device="cpu", max_model_len=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def image_host():
    hits = []
    png = _png(make_image(40, 30, 0))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}", hits
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("host", ["{addr}", "localhost:{port}", "2130706433:{port}", "[::ffff:127.0.0.1]:{port}"])
def test_image_urls_into_the_servers_network_are_400(llava, image_host, host):
    addr, hits = image_host
    before = len(hits)
    start = time.perf_counter()
    url = "http://" + host.format(addr=addr, port=addr.split(":")[1]) + "/cat.png"
    _assert_400(_chat(llava, url), start, "media URLs must point to public addresses")
    assert len(hits) == before


@pytest.mark.parametrize("name", list(hostile_images()))
def test_hostile_image_bytes_are_400(llava, name):
    start = time.perf_counter()
    _assert_400(_chat(llava, _data_url(hostile_images()[name])), start)


def test_the_vision_server_still_serves_after_hostile_images(llava):
    assert _chat(llava, _data_url(_png(make_image(40, 30, 1)))).status_code == 200
    assert httpx.get(llava.url + "/health").status_code == 200
    assert llava.engine_client.get_stats().kv_cache_usage == 0.0


@pytest.fixture(scope="module")
def whisper():
    srv = start_server(str(whisper_dir("tiny.en")), served_model_name=["whisper-1"])
    # A test knob (as test_vision_api's): a 60 s duration limit keeps the bombs' refusals cheap.
    srv.engine_client.processor.mm_config.max_audio_duration_s = 60.0
    yield srv
    srv.stop()


def _transcribe(server, data: bytes, filename: str = "audio.bin") -> httpx.Response:
    return httpx.post(server.base_url + "/audio/transcriptions", files={"file": (filename, data)},
                      data={"model": "whisper-1"}, timeout=60)


@pytest.mark.parametrize("name", list(hostile_audio()))
def test_hostile_audio_uploads_are_400(whisper, name):
    start = time.perf_counter()
    _assert_400(_transcribe(whisper, hostile_audio()[name]), start)


def test_the_whisper_server_still_transcribes_after_hostile_audio(whisper):
    r = _transcribe(whisper, (AUDIO_DIR / "fox.wav").read_bytes(), "fox.wav")
    assert r.status_code == 200 and "fox" in r.json()["text"].lower()
    assert httpx.get(whisper.url + "/health").status_code == 200
