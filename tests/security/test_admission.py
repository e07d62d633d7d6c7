"""Admission: what one request may cost before it runs, refused before the cost is paid.

- A request's images are bounded in decoded pixels (``--max-image-pixels-per-request``) and in number
  (``--limit-mm-per-prompt``, 16 images by default), checked from the headers: a chat with 40 (or 2)
  copies of a solid 7000x7000 PNG is a 400 without any image decoded.
- ``--max-queued-requests`` counts prompts x n sequences from a request's arrival, before its media are
  fetched or decoded: a burst of image requests beyond it gets 503s with Retry-After, nothing decoded for
  the refused ones; the pixels being decoded server-wide are bounded too (503).
- ``{"prompt": ["a"] * 1000, "n": 256}`` is a 400 before anything is tokenized.
- A 30 MB prompt is a 400 without tokenizing all of it, off the event loop: /health answers meanwhile.
- An image URL refused for where it points names no address the host resolves to.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
import zlib

import httpx
import psutil
import pytest
from PIL import ImageFile

import engine.processor as processor_module
from engine.server.errors import RETRY_AFTER_S
from tests.security.health import HealthPoller
from tests.server.conftest import start_server, wait_until
from tests.server.test_concurrency import _idle_and_free
from tests.server.test_errors import assert_error
from tests.server.test_front_door import long_llama_dir  # noqa: F401 - the 8k-context model
from tests.vision.conftest import build_tiny_llava, make_image


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------
def solid_png(width_px: int, height_px: int) -> bytes:
    """A black RGB PNG of this size, written row by row (never held decoded: 7000x7000 is 147 MB raw)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * width_px)
    idat = b"".join(z.compress(row) for _ in range(height_px)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def small_png(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    make_image(40, 30, seed).save(buf, format="PNG")
    return buf.getvalue()


def chat_body(urls: list[str], **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "Hi?"}]
    return {"model": "llava", "max_tokens": 2, "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture
def decodes(monkeypatch) -> list[tuple[int, int]]:
    """Every image decoded in this process (``ImageFile.load`` of an image not yet decoded), by size."""
    calls: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def counting_load(self):
        if getattr(self, "tile", None):   # still encoded: this call decodes it
            calls.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return calls


# ----------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """2 sequences run at once, 2 more may wait."""
    srv = start_server(str(build_tiny_llava(tmp_path_factory.mktemp("llava"))), served_model_name=["llava"],
                       dtype="float32", device="cpu", max_model_len=256, max_num_seqs=2, max_queued_requests=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def big_png() -> bytes:
    return solid_png(7000, 7000)


def test_forty_huge_images_are_a_400_before_any_is_decoded(llava, big_png, decodes):
    assert len(big_png) < 300_000   # a small body that decodes into 147 MB per image
    rss_before = psutil.Process().memory_info().rss
    with HealthPoller(llava) as health:
        r = httpx.post(llava.url + "/v1/chat/completions", json=chat_body([data_url(big_png)] * 40), timeout=60)
    err = assert_error(r, 400)
    assert err["param"] in ("messages", "multi_modal_data"), err
    assert "at most 16 image" in err["message"] and "--limit-mm-per-prompt" in err["message"], err
    assert decodes == []
    health.assert_answered_within()
    assert psutil.Process().memory_info().rss - rss_before < 100 << 20


def test_images_beyond_the_request_pixel_budget_are_a_400_before_any_is_decoded(llava, big_png, decodes):
    rss_before = psutil.Process().memory_info().rss
    with HealthPoller(llava) as health:
        r = httpx.post(llava.url + "/v1/chat/completions", json=chat_body([data_url(big_png)] * 2), timeout=60)
    err = assert_error(r, 400, "messages")
    assert "--max-image-pixels-per-request" in err["message"] and "98000000" in err["message"], err
    assert decodes == []
    health.assert_answered_within()
    assert psutil.Process().memory_info().rss - rss_before < 100 << 20
    assert llava.engine_client.processor.media_budget.num_pixels == 0
    assert llava.engine_client.processor.media_budget.num_bytes == 0
    assert wait_until(lambda: llava.engine_client.num_tracked_requests == 0)


def _slow(monkeypatch, name: str, delay_s: float, started: threading.Event | None = None) -> None:
    """Make ``engine.processor.<name>`` (what the processor calls to read or decode an image) sleep first."""
    real = getattr(processor_module, name)

    def slow(*args, **kwargs):
        if started is not None:
            started.set()
        time.sleep(delay_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(processor_module, name, slow)


def _post_all(server, bodies: list[dict]) -> list[httpx.Response]:
    """POST the chat bodies at once (one thread each); the responses in order."""
    responses: list = [None] * len(bodies)

    def post(i: int) -> None:
        responses[i] = httpx.post(server.url + "/v1/chat/completions", json=bodies[i], timeout=60)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return responses


def test_a_burst_beyond_the_queue_bound_gets_503s_and_nothing_is_decoded_for_them(llava, decodes,
                                                                                   monkeypatch):
    """The bound (2 running + 2 waiting) counts requests whose images are still being read: the 5th to
    8th requests of a burst are refused at arrival, their images never fetched or decoded."""
    _slow(monkeypatch, "read_image_source", 2.0)
    bodies = [chat_body([data_url(small_png(i))]) for i in range(8)]
    with HealthPoller(llava) as health:
        responses = _post_all(llava, bodies)
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 4 + [503] * 4, [r.text for r in responses]
    for r in responses:
        if r.status_code == 503:
            err = assert_error(r, 503)
            assert r.headers["retry-after"] == str(RETRY_AFTER_S) and "--max-queued-requests" in err["message"]
    assert len(decodes) == 4   # one image per admitted request, none for the refused
    health.assert_answered_within()
    assert wait_until(lambda: llava.engine_client.num_tracked_requests == 0 and _idle_and_free(llava))
    assert llava.engine_client.num_sequences_in_flight == 0


def test_pixels_in_flight_server_wide_are_bounded(llava, decodes, monkeypatch):
    """While one request's image is decoded, another whose pixels would pass the server's in-flight bound
    (--max-image-pixels-in-flight, here 1.5 images) is a 503 with Retry-After, its image not decoded."""
    budget = llava.engine_client.processor.media_budget
    monkeypatch.setattr(budget, "max_pixels", 40 * 30 * 3 // 2)
    started = threading.Event()
    _slow(monkeypatch, "finish_decode", 2.0, started)
    first: list = []
    thread = threading.Thread(target=lambda: first.append(httpx.post(
        llava.url + "/v1/chat/completions", json=chat_body([data_url(small_png(1))]), timeout=60)))
    thread.start()
    try:
        assert started.wait(20) and budget.num_pixels == 40 * 30
        r = httpx.post(llava.url + "/v1/chat/completions", json=chat_body([data_url(small_png(2))]), timeout=60)
        err = assert_error(r, 503)
        assert r.headers["retry-after"] == str(RETRY_AFTER_S) and "--max-image-pixels-in-flight" in err["message"]
    finally:
        thread.join(60)
    assert first[0].status_code == 200, first[0].text
    assert len(decodes) == 1
    assert budget.num_pixels == 0 and budget.num_bytes == 0
    assert wait_until(lambda: llava.engine_client.num_tracked_requests == 0 and _idle_and_free(llava))


def test_an_image_url_refusal_names_no_internal_address(llava):
    for host in ("localhost", "127.0.0.1", "[::1]"):
        r = httpx.post(llava.url + "/v1/chat/completions", timeout=30,
                       json=chat_body([f"http://{host}:9/cat.png"]))
        err = assert_error(r, 400, "messages")
        assert "not allowed" in err["message"], err
        message = err["message"].replace(f"http://{host}:9/cat.png", "")
        assert "127.0.0.1" not in message and "::1" not in message and "resolves to" not in message, err


# ----------------------------------------------------------------------------------------
# Sequences and prompts
# ----------------------------------------------------------------------------------------
MODEL = "tiny-long"


@pytest.fixture(scope="module")
def text_server(long_llama_dir):  # noqa: F811
    """2 sequences run at once, 2 more may wait; bodies up to 64 MB."""
    srv = start_server(str(long_llama_dir), served_model_name=[MODEL], max_num_seqs=2, max_queued_requests=2,
                       max_request_body_bytes=64 << 20)
    yield srv
    srv.stop()


@pytest.fixture
def processed(text_server, monkeypatch) -> list[str]:
    """Request ids the processor (validation, tokenization) was called for."""
    calls: list[str] = []
    processor = text_server.engine_client.processor
    real = processor.process

    def counting(request_id, *args, **kwargs):
        calls.append(request_id)
        return real(request_id, *args, **kwargs)

    monkeypatch.setattr(processor, "process", counting)
    return calls


def test_prompts_times_n_beyond_what_could_ever_fit_is_a_400_before_tokenizing(text_server, processed):
    url = text_server.url + "/v1/completions"
    with HealthPoller(text_server) as health:
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 1000, "n": 2, "max_tokens": 1}, timeout=30)
        err = assert_error(r, 400, "prompt")
        assert "2000 sequences" in err["message"] and "--max-queued-requests" in err["message"], err
        err = assert_error(httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 1000, "n": 256,
                                                 "max_tokens": 1}, timeout=30), 400, "n")
        assert "at most 2 samples" in err["message"], err
        assert_error(httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 1}, timeout=30),
                     400, "prompt")
    assert processed == []
    health.assert_answered_within()
    r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    assert wait_until(lambda: text_server.engine_client.num_sequences_in_flight == 0)


def _open_stream(server, body: dict):
    import socket
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_the_queue_bound_counts_sequences(text_server, processed):
    """Two running requests with n=2 fill the bound of 4 sequences: one more sequence is a 503."""
    client = text_server.engine_client
    long = {"model": MODEL, "prompt": "A", "n": 2, "max_tokens": 4000, "ignore_eos": True}
    socks = [_open_stream(text_server, long) for _ in range(2)]
    try:
        # Sequences count from arrival, tracked requests once the engine has them: wait for both.
        assert wait_until(lambda: client.num_sequences_in_flight == 4 and client.num_tracked_requests == 2,
                          timeout_s=20), (client.num_sequences_in_flight, client.num_tracked_requests)
        r = httpx.post(text_server.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "A", "max_tokens": 1})
        assert_error(r, 503)
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert len(processed) == 2   # the refused one was not tokenized
    finally:
        for sock in socks:
            sock.close()
    assert wait_until(lambda: client.num_tracked_requests == 0 and _idle_and_free(text_server), timeout_s=20)
    assert client.num_sequences_in_flight == 0


def test_a_30_mb_prompt_is_a_400_without_stalling_the_server(text_server):
    prompt = "lorem ipsum " * (30_000_000 // 12)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    with HealthPoller(text_server) as health:
        t0 = time.monotonic()
        r = httpx.post(text_server.url + "/v1/completions", content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        took_s = time.monotonic() - t0
    err = assert_error(r, 400, "prompt")
    assert "maximum context length" in err["message"] and "characters long" in err["message"], err
    assert took_s < 10.0
    health.assert_answered_within()
    assert wait_until(lambda: text_server.engine_client.num_tracked_requests == 0)


def test_a_prompt_just_within_the_length_is_still_served(text_server):
    """The early refusal only takes prompts certainly too long: one that fits runs."""
    r = httpx.post(text_server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "lorem ipsum " * 300, "max_tokens": 1})
    assert r.status_code == 200, r.text
