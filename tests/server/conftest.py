"""Server fixtures: a real uvicorn server on 127.0.0.1 (free port) in a background thread.

One server per test module (module-scoped fixtures) keeps the suite fast on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    """http://127.0.0.1:PORT"""
    app: Any
    engine_client: Any
    server: Any
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def call_engine(self, call: Any) -> Any:
        """``engine_client.call_engine(call)`` (an ``EngineCall``) from a test thread, on the server's
        event loop."""
        future = asyncio.run_coroutine_threadsafe(self.engine_client.call_engine(call),
                                                  self.engine_client._loop)
        return future.result(30)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` (matching labels) in /metrics."""
        text = httpx.get(self.url + "/metrics").text
        return parse_metric(text, name, **labels)


def parse_metric(text: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, value = line.rsplit(" ", 1)
        metric = key.split("{", 1)[0]
        if metric != name:
            continue
        if any(f'{k}="{v}"' not in key for k, v in labels.items()):
            continue
        total += float(value)
        found = True
    if not found:
        raise KeyError(f"metric {name} {labels} not in /metrics")
    return total


def start_server(model: str, engine_kwargs: dict | None = None, **serve_overrides: Any) -> RunningServer:
    """Build the engine + app for ``model`` and serve it from a thread; returns once it accepts."""
    import uvicorn

    from engine.async_llm import AsyncLLM
    from engine.server.app import build_app
    from engine.server.args import engine_kwargs as to_engine_kwargs
    from engine.server.args import make_serve_namespace, request_limits

    args = make_serve_namespace(model_tag=model, disable_log_requests=True, **serve_overrides)
    kwargs = to_engine_kwargs(args)
    kwargs.update(engine_kwargs or {})
    engine_client = AsyncLLM.from_engine_args(log_requests=False,
                                              engine_process=getattr(args, "engine_process", False),
                                              limits=request_limits(args), **kwargs)
    app = build_app(engine_client, args)
    # NOTE: uvicorn serves a socket bound here (a free port, chosen by the OS) instead of binding a
    # port number itself: no other process (another xdist worker) can take the port in between.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds its own
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", app, engine_client, server, thread)


@pytest.fixture(scope="module")
def llama_server(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=256)
    yield srv
    srv.stop()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
