"""The server's front door: bodies that are not JSON, the API key policy, body size caps (chunked and
multipart uploads included, refused before the rest is read), and slow clients: a body that trickles in
gets a 408, a stream nobody reads is aborted in the engine and its connection closed."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

import engine.server.guards as guards
from tests.audio.whisper_reference import whisper_dir
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import start_server, wait_until
from tests.server.test_concurrency import _idle_and_free
from tests.server.test_errors import assert_error

MODEL = "tiny-long"
KEY = "sk-front-door"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 50_000
SLOW_CLIENT_TIMEOUT_S = 1.0
JSON_TYPE = {"Content-Type": "application/json"}


@pytest.fixture(scope="session")
def long_llama_dir(tmp_path_factory):
    """The tiny model with an 8k context: a request can run for tens of seconds (~6 ms per token)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(long_llama_dir):
    srv = start_server(str(long_llama_dir), served_model_name=[MODEL], api_key=KEY,
                       max_request_body_bytes=BODY_LIMIT, slow_client_timeout=SLOW_CLIENT_TIMEOUT_S)
    yield srv
    srv.stop()


def post(server, path: str, content: bytes, headers: dict) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={**AUTH, **headers}, timeout=30)


def raw_request(server, head: str, body: bytes = b"", rcvbuf: int = 0) -> socket.socket:
    """A socket that sent ``head`` (CRLF line ends added, the API key included) and ``body``."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)   # before connect: fixes the window
    sock.connect(("127.0.0.1", port))
    lines = [*head.strip().splitlines(), f"Authorization: Bearer {KEY}", "", ""]
    sock.sendall("\r\n".join(lines).encode() + body)
    return sock


def successes(server) -> float:
    """Requests finished so far (0 before the first: the counter has no sample yet)."""
    try:
        return server.metric("chorus:request_success_total")
    except KeyError:
        return 0.0


def read_until_closed(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:   # the server closed with our unread bytes queued: its reply came first
        pass
    sock.close()
    return data


def send_chunks(sock: socket.socket, chunk: bytes, count: int) -> None:
    """Send `count` chunked-encoding chunks, stopping when the server has answered and closed."""
    try:
        for _ in range(count):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (ConnectionResetError, BrokenPipeError):
        pass


# ------------------------------------------------------------------------------------------
# Bodies that are not JSON
# ------------------------------------------------------------------------------------------
def test_invalid_json_says_line_and_column(server):
    body = b'{"model": "tiny-long",\n  "prompt": "A",\n  "max_tokens": }'
    err = assert_error(post(server, "/v1/completions", body, {"Content-Type": "application/json"}), 400, None)
    assert "not valid JSON" in err["message"] and "line 3 column 17" in err["message"], err
    err = assert_error(post(server, "/v1/chat/completions", b"{not json", JSON_TYPE), 400, None)
    assert "line 1 column 2 (char 1)" in err["message"], err


@pytest.mark.parametrize("content_type, words", [
    ("text/plain", "Content-Type 'text/plain' is not supported"),
    ("application/x-www-form-urlencoded", "Content-Type 'application/x-www-form-urlencoded'"),
    (None, "without Content-Type"),
])
def test_non_json_content_type_says_so(server, content_type, words):
    body = json.dumps({"model": MODEL, "prompt": "A", "max_tokens": 2}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/completions", "/tokenize"):
        err = assert_error(post(server, path, body, headers), 400, None)
        assert words in err["message"] and "application/json" in err["message"], err
    # The same body as JSON (with parameters) is served.
    ok = post(server, "/v1/completions", body, {"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_empty_and_wrong_shape_bodies(server):
    err = assert_error(post(server, "/v1/completions", b"", {"Content-Type": "application/json"}), 400, None)
    assert "body is empty" in err["message"]
    err = assert_error(post(server, "/v1/completions", b"[1, 2]", {"Content-Type": "application/json"}), 400)
    assert "not valid JSON" not in err["message"] and "Content-Type" not in err["message"]   # wrong shape


# ------------------------------------------------------------------------------------------
# API key
# ------------------------------------------------------------------------------------------
def test_api_key_policy_and_constant_time_compare(server, monkeypatch):
    """Every route needs the key but /health, /metrics, /version and /ping (vLLM guards /v1/* only)."""
    compared = []
    real = guards.hmac.compare_digest
    monkeypatch.setattr(guards.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    completion = json.dumps({"model": MODEL, "prompt": "A", "max_tokens": 1}).encode()
    for auth in (None, "Bearer wrong", KEY, "Basic"):
        headers = {"Authorization": auth} if auth else {}
        assert_error(httpx.get(server.url + "/v1/models", headers=headers), 401)
        assert_error(httpx.post(server.url + "/v1/completions", content=completion,
                                headers={**headers, **JSON_TYPE}), 401)
        assert_error(httpx.post(server.url + "/v1/chat/completions", json={}, headers=headers), 401)
    assert len(compared) >= 12   # every check went through hmac.compare_digest
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/metrics", "/version", "/ping"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "A"}), 401)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "A"}, headers=AUTH).status_code == 200


# ------------------------------------------------------------------------------------------
# Body size caps
# ------------------------------------------------------------------------------------------
def test_declared_body_over_the_cap_is_refused_before_it_is_sent(server):
    sock = raw_request(server, f"""POST /v1/completions HTTP/1.1
Host: x
Content-Type: application/json
Content-Length: {BODY_LIMIT + 1}""")
    reply = read_until_closed(sock)   # answered, and closed, though no body byte was sent
    assert reply.startswith(b"HTTP/1.1 413 ") and b"larger than the limit" in reply, reply[:300]


def test_a_client_that_sends_its_whole_body_first_still_reads_the_413(server):
    """httpx and the OpenAI SDK send the whole body before they read the reply. The server reads and drops
    the rest of an over-cap body before it closes: a socket closed with unread bytes is reset by the
    kernel, and the client would lose the 413 (or fail mid-upload)."""
    body = b"x" * (16 << 20)   # more than the two sockets' buffers hold
    sock = raw_request(server, f"""POST /v1/completions HTTP/1.1
Host: x
Content-Type: application/json
Content-Length: {len(body)}""", body)   # sendall: fails if the server closes before it has all of it
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:300]
    assert reply.endswith(b'"type":"RequestEntityTooLargeError","param":null,"code":413}}'), reply[-300:]


def test_chunked_body_over_the_cap_is_refused_while_it_arrives(server):
    sock = raw_request(server, """POST /v1/completions HTTP/1.1
Host: x
Content-Type: application/json
Transfer-Encoding: chunked""")
    chunk = b"x" * 4096
    send_chunks(sock, chunk, BODY_LIMIT // len(chunk) + 2)   # past the cap, and the body never ends
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"larger than the limit" in reply, reply[:300]
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def whisper_server():
    srv = start_server(str(whisper_dir("tiny.en")), served_model_name=["tiny.en"], kv_cache_space=0.25,
                       max_num_seqs=4, max_request_body_bytes=BODY_LIMIT)
    yield srv
    srv.stop()


def test_audio_upload_over_the_cap_is_refused(server, whisper_server):
    big = b"\0" * (BODY_LIMIT + 1000)
    # With Content-Length (what httpx and the OpenAI SDK send): refused from the headers.
    r = httpx.post(server.url + "/v1/audio/transcriptions", headers=AUTH, files={"file": ("a.wav", big)},
                   data={"model": MODEL}, timeout=30)
    err = assert_error(r, 413, "file")
    assert "25 MB" in err["message"]
    # Chunked multipart into a Whisper server: its route reads the form, the cap stops it mid-way.
    boundary = "chorusboundary"
    part_head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                 "Content-Type: audio/wav\r\n\r\n").encode()
    port = int(whisper_server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())
    sock.sendall(b"%x\r\n%s\r\n" % (len(part_head), part_head))
    chunk = b"\1" * 4096
    send_chunks(sock, chunk, BODY_LIMIT // len(chunk) + 2)
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b'"param":"file"' in reply, reply[:400]
    assert whisper_server.engine_client._states == {}


# ------------------------------------------------------------------------------------------
# Slow clients
# ------------------------------------------------------------------------------------------
def test_body_that_trickles_in_gets_408(server):
    body = json.dumps({"model": MODEL, "prompt": "A " * 300, "max_tokens": 2}).encode()
    sock = raw_request(server, f"""POST /v1/completions HTTP/1.1
Host: x
Content-Type: application/json
Content-Length: {len(body)}""", body[:len(body) // 2])   # half the body, then nothing
    t0 = time.monotonic()
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"--slow-client-timeout" in reply, reply[:300]
    assert SLOW_CLIENT_TIMEOUT_S * 0.9 <= time.monotonic() - t0 < 15
    assert server.engine_client._states == {}
    ok = post(server, "/v1/completions", body, {"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_stream_nobody_reads_is_aborted_and_its_blocks_freed(server):
    """A client that stops reading: once the socket buffers are full, the server's send waits; after
    --slow-client-timeout the engine request is aborted (long before its 4000 tokens) and the
    connection closed."""
    listener = server.server.servers[0].sockets[0]
    sndbuf = listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # accepted sockets inherit it
    success_before = successes(server)
    try:
        body = json.dumps({"model": MODEL, "prompt": "A", "max_tokens": 4000, "ignore_eos": True,
                           "stream": True, "logprobs": 5}).encode()
        sock = raw_request(server, f"""POST /v1/completions HTTP/1.1
Host: x
Content-Type: application/json
Content-Length: {len(body)}""", body, rcvbuf=4096)
        assert wait_until(lambda: server.engine_client.get_stats().num_running_reqs == 1, timeout_s=20)
        # Never read: the engine must drop the request well before it could finish (~25 s of decode).
        assert wait_until(lambda: _idle_and_free(server), timeout_s=15)
        assert successes(server) == success_before   # aborted, not finished
        assert server.engine_client._states == {}
        data = read_until_closed(sock)   # what the buffers held, then the server's close
        assert data.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in data
    finally:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf // 2)   # Linux doubles it
    r = post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "A", "max_tokens": 2}).encode(),
             {"Content-Type": "application/json"})
    assert r.status_code == 200
