"""Who may call what: with an API key set, every route of the app (every optional one mounted) answers
401 without the key, with a wrong one and with a key that is not a Bearer token, for each of its methods;
only ``guards.OPEN_ROUTES`` (/health, /metrics, /version, /ping) answer without it. Anthropic's SDK sends
the key as ``x-api-key``, which opens every route too; /v1/messages answers its 401 in Anthropic's shape.
Unknown paths are a
401 too (routes are not revealed), /docs, /redoc and /openapi.json need the key, CORS preflights pass.
A route added to the app without a decision fails ``test_every_route_needs_the_key_but_the_open_ones``
(it answers without the key) or ``test_open_routes_are_exactly_the_documented_ones``."""

from __future__ import annotations

import functools
import re

import httpx
import pytest
from starlette.routing import Route

from engine.server import guards
from tests.server.conftest import start_server
from tests.server.test_errors import assert_error

MODEL = "tiny-routes"
KEY = "sk-routes"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP_ORIGIN = "https://app.example"
EVIL_ORIGIN = "https://evil.example"
DOCUMENTED_OPEN_ROUTES = ("/health", "/metrics", "/version", "/ping")
BAD_AUTH = [None, "Bearer wrong", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"]
"""Authorization headers that are not the key: none, a wrong key, the key without ``Bearer``, ..."""
BAD_X_API_KEYS = ["wrong", f"Bearer {KEY}", f"{KEY}x", KEY[:-1], ""]
"""x-api-key headers (Anthropic's SDK) that are not the key."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """Every optional route mounted (runtime adapter updating; the audio routes are always mounted), an
    explicit CORS origin list with credentials."""
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=64, api_key=KEY,
                       allow_runtime_lora_updating=True, enable_lora=True, max_loras=1,
                       allowed_origins=[APP_ORIGIN], allow_credentials=True)
    yield srv
    srv.stop()


def route_table(app) -> list[tuple[str, str]]:
    """``(method, path)`` of every route of ``app`` (path parameters filled in)."""
    out = []
    for route in app.routes:
        assert isinstance(route, Route), f"{route!r}: a mount or websocket route; decide its key policy"
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        out.extend((method, path) for method in sorted(route.methods or ()))
    return out


def call(server, method: str, path: str, auth: str | None, x_api_key: str | None = None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else {}
    if x_api_key is not None:
        headers["x-api-key"] = x_api_key
    kwargs = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
    return _client().request(method, server.url + path, headers=headers, **kwargs)


@functools.cache
def _client() -> httpx.Client:
    """One keep-alive client for the hundreds of calls (a client per call costs ~30 ms to build)."""
    return httpx.Client(timeout=30)


def assert_unauthorized(r: httpx.Response, path: str) -> None:
    """A 401 in the route's error shape: Anthropic's on ``guards.ANTHROPIC_ROUTES``, else OpenAI's."""
    if path in guards.ANTHROPIC_ROUTES:
        assert r.status_code == 401, r.text
        assert r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "Unauthorized: missing or invalid API key."}}
    else:
        err = assert_error(r, 401, None)
        assert err["type"] == "AuthenticationError", (path, err)


def test_open_routes_are_exactly_the_documented_ones(server):
    assert guards.OPEN_ROUTES == DOCUMENTED_OPEN_ROUTES
    paths = {path for _, path in route_table(server.app)}
    assert set(DOCUMENTED_OPEN_ROUTES) <= paths   # each open route exists


def test_the_route_table_holds_every_optional_route(server):
    """The walk below covers the routes that need a decision: adapters, audio, tokenizer, docs."""
    table = set(route_table(server.app))
    for expected in [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                     ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations"),
                     ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
                     ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                     ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
                     ("GET", "/ping"), ("POST", "/ping"), ("POST", "/v1/messages")]:
        assert expected in table, expected


def test_every_route_needs_the_key_but_the_open_ones(server):
    table = route_table(server.app)
    assert len(table) >= 20
    for method, path in table:
        if path in DOCUMENTED_OPEN_ROUTES:
            r = call(server, method, path, None)
            assert r.status_code == 200, (method, path, r.status_code, r.text)
            continue
        bad = [(auth, None) for auth in BAD_AUTH] + [(None, x_api_key) for x_api_key in BAD_X_API_KEYS]
        for auth, x_api_key in bad:
            r = call(server, method, path, auth, x_api_key)
            if method == "HEAD":
                assert r.status_code == 401, (method, path, auth, x_api_key)
            else:
                assert_unauthorized(r, path)
        r = call(server, method, path, AUTH["Authorization"])   # the key opens it (a 4xx of the route)
        assert r.status_code != 401, (method, path, r.text)
        r = call(server, method, path, None, KEY)   # so does x-api-key: <key>
        assert r.status_code != 401, (method, path, r.text)


def test_unknown_paths_are_401_without_the_key_and_404_with_it(server):
    for method, path in [("GET", "/no/such/route"), ("POST", "/v1/nope"), ("GET", "/admin"),
                         ("GET", "/health/"), ("GET", "/HEALTH"), ("DELETE", "/v1/models"),
                         ("GET", "/docs/oauth2-redirect/x")]:
        for auth in BAD_AUTH:
            assert_error(call(server, method, path, auth), 401, None)
        status = call(server, method, path, AUTH["Authorization"]).status_code
        assert status in (404, 405, 307), (method, path, status)   # 307: starlette's trailing-slash redirect


def test_docs_need_the_key(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(httpx.get(server.url + path), 401, None)
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path
    spec = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    assert "/tokenize" in spec["paths"]


def test_tokenizer_routes_need_the_key(server):
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "A"}), 401, None)
    assert_error(httpx.post(server.url + "/detokenize", json={"tokens": [1, 2]}), 401, None)
    ok = httpx.post(server.url + "/tokenize", json={"prompt": "A"}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["count"] >= 1, ok.text


def test_ping_answers_as_health(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping", timeout=10)
        assert r.status_code == 200 and r.content == b"", (method, r.text)
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(server.url + "/version").json()["version"]


def test_cors_preflight_is_open_and_credentials_go_to_listed_origins_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(server.url + "/v1/completions", headers={"Origin": APP_ORIGIN, **preflight})
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == APP_ORIGIN
    assert ok.headers["access-control-allow-credentials"] == "true"
    evil = httpx.options(server.url + "/v1/completions", headers={"Origin": EVIL_ORIGIN, **preflight})
    assert evil.status_code == 400
    assert "access-control-allow-origin" not in evil.headers
    simple = httpx.get(server.url + "/v1/models", headers={"Origin": EVIL_ORIGIN, **AUTH})
    assert simple.status_code == 200
    assert "access-control-allow-origin" not in simple.headers   # the browser keeps the answer from the page
    listed = httpx.get(server.url + "/v1/models", headers={"Origin": APP_ORIGIN, **AUTH})
    assert listed.headers["access-control-allow-origin"] == APP_ORIGIN
    assert listed.headers["access-control-allow-credentials"] == "true"
