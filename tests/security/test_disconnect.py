"""Every stream is closed with its exchange: a client that leaves while its image is still being processed,
or before its streaming response's first chunk, leaves no request state, sequence count, KV block or encoder
entry behind (n > 1 too); a request dropped during preprocessing never reaches the engine, and its image is
not decoded."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest

from engine.core_messages import AddRequest
from tests.security.test_admission import _slow, chat_body, data_url, decodes, small_png  # noqa: F401
from tests.server.conftest import start_server, wait_until
from tests.server.test_concurrency import _idle_and_free
from tests.vision.conftest import build_tiny_llava


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    srv = start_server(str(build_tiny_llava(tmp_path_factory.mktemp("llava"))), served_model_name=["llava"],
                       dtype="float32", device="cpu", max_model_len=256)
    # One request binds the engine client to the server's event loop (the ASGI-level tests run on it).
    r = httpx.post(srv.base_url + "/completions", json={"model": "llava", "prompt": "a", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    yield srv
    srv.stop()


@pytest.fixture
def added(llava, monkeypatch) -> list[str]:
    """Ids of the requests the client sent to the engine core (``AddRequest``)."""
    ids: list[str] = []
    transport = llava.engine_client._transport
    real_send = transport.send

    def send(message):
        if isinstance(message, AddRequest):
            ids.append(message.request_id)
        return real_send(message)

    monkeypatch.setattr(transport, "send", send)
    return ids


def _all_released(server) -> bool:
    """No request state, sequence count, scheduler request, KV block or referenced encoder-cache entry."""
    client = server.engine_client
    core = client._transport.core
    ecm = core.scheduler.encoder_cache_manager
    return (client.num_tracked_requests == 0 and client.num_sequences_in_flight == 0 and not client._states
            and not client.output_processor.parents and not client.output_processor.children
            and not core.scheduler.has_unfinished_requests() and _idle_and_free(server)
            and all(not refs for refs in ecm.cached.values()) and ecm.num_freeable_slots == ecm.cache_size)


def _send_raw(server, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return sock


@pytest.mark.parametrize("stream, n", [(True, 1), (False, 1), (True, 3)])
def test_disconnect_while_the_image_is_processed_leaves_nothing(llava, added, decodes, monkeypatch, stream, n):
    started = threading.Event()
    _slow(monkeypatch, "read_image_source", 1.5, started)
    rid = f"gone-{int(stream)}-{n}"
    sock = _send_raw(llava, "/v1/chat/completions",
                     chat_body([data_url(small_png())], stream=stream, n=n, max_tokens=200, request_id=rid))
    try:
        assert started.wait(20)
        assert llava.engine_client.num_tracked_requests == 1   # tracked from arrival, while preprocessed
        assert llava.engine_client.num_sequences_in_flight == n
    finally:
        sock.close()
    assert wait_until(lambda: _all_released(llava), timeout_s=20)
    assert rid not in added   # dropped before it reached the engine
    assert decodes == []      # the worker skipped decoding what nobody waits for
    assert llava.engine_client.processor.media_budget.num_pixels == 0


def _asgi_scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"host", b"x"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


async def _exchange_that_leaves_before_the_first_chunk(app, path: str, body: dict) -> list[dict]:
    """Run one exchange on ``app`` whose client sends ``body`` and is gone by the time the response starts:
    the route's own disconnect watch sees nothing (its receive waits), the response's sees a disconnect."""
    num_receives = 0
    never = asyncio.Event()
    gone = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal num_receives
        num_receives += 1
        if num_receives == 1:
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if num_receives == 2:   # the route's watch while the request is submitted
            await never.wait()
        gone.set()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":   # the client is gone before the first chunk is sent
            await gone.wait()
            await asyncio.sleep(0.1)   # the response's disconnect watch cancels the exchange meanwhile

    await app(_asgi_scope(path), receive, send)
    return sent


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body([data_url(small_png())], stream=True, max_tokens=200, ignore_eos=True)),
    ("/v1/chat/completions", chat_body([], stream=True, n=2, max_tokens=200, ignore_eos=True)),
    ("/v1/completions", {"model": "llava", "prompt": ["a", "b"], "n": 2, "stream": True, "max_tokens": 200,
                         "ignore_eos": True}),
])
def test_disconnect_before_the_first_chunk_aborts_the_stream(llava, added, path, body):
    before = len(added)
    sent = asyncio.run_coroutine_threadsafe(
        _exchange_that_leaves_before_the_first_chunk(llava.app, path, body), llava.engine_client._loop).result(60)
    assert len(added) > before   # the requests were added ...
    assert not any(m.get("body", b"").startswith(b"data: {") for m in sent if m["type"] == "http.response.body")
    assert wait_until(lambda: _all_released(llava), timeout_s=20)   # ... and aborted with the exchange
    assert llava.engine_client.get_stats().kv_cache_usage == 0.0


def test_disconnect_mid_stream_with_n_above_1_leaves_nothing(llava):
    sock = _send_raw(llava, "/v1/chat/completions",
                     chat_body([data_url(small_png(3))], stream=True, n=3, max_tokens=200, ignore_eos=True))
    try:
        sock.settimeout(30)
        received = b""
        while b"data: {" not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    finally:
        sock.close()
    assert wait_until(lambda: _all_released(llava), timeout_s=20)
