"""Overload: past --max-num-seqs running and --max-queued-requests waiting, a request gets a 503 with
Retry-After (nothing queues without bound), /health still answers at once; --request-timeout aborts a
request in the engine (its KV blocks are freed) with a 504, or an in-band error event on a stream."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from engine.server.errors import RETRY_AFTER_S
from tests.server.conftest import start_server, wait_until
from tests.server.test_concurrency import _idle_and_free
from tests.server.test_errors import assert_error
from tests.server.test_front_door import long_llama_dir, successes  # noqa: F401 - the 8k-context model

MODEL = "tiny-long"
LONG = {"model": MODEL, "prompt": "A", "max_tokens": 4000, "ignore_eos": True}
"""~25 s of decode on the tiny model: a request that is still running whenever a test looks."""


@pytest.fixture(scope="module")
def small_server(long_llama_dir):  # noqa: F811
    """2 requests run at once, 2 more may wait."""
    srv = start_server(str(long_llama_dir), served_model_name=[MODEL], max_num_seqs=2, max_queued_requests=2)
    yield srv
    srv.stop()


def open_stream(server, body: dict) -> socket.socket:
    """A streamed completion sent on a raw socket that reads nothing (closing it aborts the request)."""
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_full_queue_is_a_503_with_retry_after_and_health_stays_fast(small_server):
    server = small_server
    socks = [open_stream(server, LONG) for _ in range(4)]   # 2 running + 2 waiting
    try:
        assert wait_until(lambda: len(server.engine_client._states) == 4, timeout_s=20)
        stats = server.engine_client.get_stats()
        assert stats.num_running_reqs <= 2
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        err = assert_error(r, 503, None)
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert err["type"] == "ServiceUnavailableError" and "--max-queued-requests" in err["message"], err
        assert_error(httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "A"}], "max_tokens": 2}), 503)
        # /health answers (a hang bound only: this process's threads share the GIL with the engine's).
        assert max(health_latencies(server, num_threads=4, num_calls=5)) < 10.0
        assert len(server.engine_client._states) == 4   # the refused ones left nothing behind
    finally:
        for sock in socks:
            sock.close()
    assert wait_until(lambda: _idle_and_free(server), timeout_s=15)
    assert server.engine_client._states == {}
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def health_latencies(server, num_threads: int, num_calls: int) -> list[float]:
    """Seconds each of ``num_threads`` x ``num_calls`` GET /health took (each must be a 200)."""
    latencies: list[float] = []

    def probe() -> None:
        for _ in range(num_calls):
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t0)

    threads = [threading.Thread(target=probe) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(latencies) == num_threads * num_calls
    return latencies


def test_health_does_not_wait_on_the_engine_loop(small_server, monkeypatch):
    """The engine loop stuck inside a step (as under a long prefill): /health still answers at once."""
    server = small_server
    core = server.engine_client._transport.core
    inside, release = threading.Event(), threading.Event()
    real_step = core.step

    def stuck_step():
        inside.set()
        release.wait(30)
        return real_step()

    monkeypatch.setattr(core, "step", stuck_step)
    sock = open_stream(server, {**LONG, "max_tokens": 4})
    try:
        assert inside.wait(20)
        assert max(health_latencies(server, num_threads=4, num_calls=5)) < 2.0
    finally:
        release.set()
        monkeypatch.undo()
        sock.close()
    assert wait_until(lambda: _idle_and_free(server), timeout_s=15)


@pytest.fixture(scope="module")
def timeout_server(long_llama_dir):  # noqa: F811
    """One request runs at a time; each may live 1 s."""
    srv = start_server(str(long_llama_dir), served_model_name=[MODEL], max_num_seqs=1, request_timeout=1.0)
    yield srv
    srv.stop()


def test_request_timeout_aborts_streams_and_queued_requests(timeout_server):
    server = timeout_server
    success_before = successes(server)
    lines: list[str] = []

    def stream() -> None:
        body = {**LONG, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t0 = time.monotonic()
    streamer = threading.Thread(target=stream)
    streamer.start()
    assert wait_until(lambda: server.engine_client.get_stats().num_running_reqs == 1, timeout_s=20)
    # The second one waits behind the first (max_num_seqs 1): its deadline counts the wait.
    queued = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)
    streamer.join(60)
    err = assert_error(queued, 504, None)
    assert err["type"] == "GatewayTimeoutError" and "--request-timeout" in err["message"], err
    assert time.monotonic() - t0 < 15   # not the ~25 s the first one needs to finish
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["error"]["code"] == 504 and "--request-timeout" in last["error"]["message"], last
    assert any(json.loads(line[6:]).get("choices") for line in lines[:-2])   # tokens came before the error
    assert wait_until(lambda: _idle_and_free(server), timeout_s=15)
    assert server.engine_client._states == {}
    assert successes(server) == success_before   # aborted, never finished
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
