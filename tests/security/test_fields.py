"""What a request's fields may cost: stop strings and stop token ids are capped (a 400 naming the field
and the bound), non-finite numbers are refused in every field, bodies nest at most ``MAX_JSON_DEPTH``
deep (deeper is a 400, never a 500), client-chosen request ids (field and ``X-Request-Id``) keep to a
log-safe charset, CORS sends no credentials to a wildcard, and a request's log line stays short. The
expensive requests are refused while /health keeps answering within a second."""

from __future__ import annotations

import functools
import json
import logging
import math
import time
import typing

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.sampling_params import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                    SamplingParams)
from engine.server.args import check_serve_args, make_serve_namespace
from engine.server.errors import install_error_handlers, to_openai_error
from engine.server.protocol import (MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest,
                                    TranscriptionRequest)
from tests.security.health import HealthPoller
from tests.server.conftest import start_server
from tests.server.test_errors import assert_error

MODEL = "tiny-fields"
EVIL_ORIGIN = "https://evil.example"
MESSAGES = [{"role": "user", "content": "A"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """Default flags (no key, CORS origins '*')."""
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=64)
    yield srv
    srv.stop()


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "A", "max_tokens": 1, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    """``body``: a dict (sent as JSON) or the raw JSON text."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return _client().post(server.url + path, content=content,
                          headers={"Content-Type": "application/json", **(headers or {})})


@functools.cache
def _client() -> httpx.Client:
    """One keep-alive client for the module's calls (a client per call costs ~30 ms to build)."""
    return httpx.Client(timeout=60)


# ------------------------------------------------------------------------------------------
# stop / stop_token_ids caps
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param, words", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", f"at most {MAX_STOP_STRING_CHARS}"),
    ({"stop": ["a", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", f"at most {MAX_STOP_STRING_CHARS}"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}"),
])
@pytest.mark.parametrize("path, make", [("/v1/completions", completion), ("/v1/chat/completions", chat)])
def test_stop_caps(server, fields, param, words, path, make):
    err = assert_error(post(server, path, make(**fields)), 400, param)
    assert words in err["message"], err


def test_stop_at_the_caps_is_served(server):
    body = completion(stop=[f"{i:04d}" + "z" * (MAX_STOP_STRING_CHARS - 4) for i in range(MAX_STOP_STRINGS)],
                      stop_token_ids=list(range(10_000, 10_000 + MAX_STOP_TOKEN_IDS)))
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields, param", [
    ({"stop": ["x"] * 200_000}, "stop"),
    ({"stop_token_ids": [7] * 1_000_000}, "stop_token_ids"),
])
def test_huge_stop_lists_with_n_256_are_refused_while_health_answers(server, fields, param):
    body = json.dumps(completion(n=256, **fields))
    with HealthPoller(server) as health:
        start = time.monotonic()
        err = assert_error(post(server, "/v1/completions", body), 400, param)
        took_s = time.monotonic() - start
    health.assert_answered_within()
    assert "at most" in err["message"] and len(err["message"]) < 200, err
    assert took_s < 10, took_s


def test_offline_sampling_params_have_the_same_caps():
    for kwargs, field in [({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
                          ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
                          ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=rf"^{field} .*at most"):
            SamplingParams(**kwargs)
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)


# ------------------------------------------------------------------------------------------
# Non-finite numbers
# ------------------------------------------------------------------------------------------
def float_fields(model) -> list[str]:
    """The fields of a request model whose type admits a float."""
    def has_float(tp) -> bool:
        return tp is float or any(has_float(arg) for arg in typing.get_args(tp))
    return sorted(name for name, info in model.model_fields.items() if has_float(info.annotation))


COMPLETION_FLOATS = float_fields(CompletionRequest)
CHAT_FLOATS = float_fields(ChatCompletionRequest)


def test_float_fields_are_found():
    expected = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
    assert expected <= set(COMPLETION_FLOATS) and expected <= set(CHAT_FLOATS)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("path, make, field", [
    *[("/v1/completions", completion, f) for f in COMPLETION_FLOATS],
    *[("/v1/chat/completions", chat, f) for f in CHAT_FLOATS],
    ("/v1/completions", completion, "length_penalty"),          # a field this server ignores
])
def test_non_finite_numbers_are_refused(server, literal, path, make, field):
    body = json.dumps(make(**{field: 0.5}))
    body = body.replace(f'"{field}": 0.5', f'"{field}": {literal}')
    assert literal in body
    err = assert_error(post(server, path, body), 400, field)
    assert "finite" in err["message"], err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "%s", "prompt": "A", "logit_bias": {"1": NaN}}' % MODEL, "logit_bias"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "A"}], '
                             '"chat_template_kwargs": {"x": [Infinity]}}' % MODEL, "chat_template_kwargs"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "A"}], '
                             '"tools": [{"type": "function", "x": -Infinity}]}' % MODEL, "tools"),
    ("/tokenize", '{"model": "%s", "prompt": "A", "x": NaN}' % MODEL, "x"),
])
def test_non_finite_numbers_are_refused_anywhere(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_offline_sampling_params_refuse_non_finite_numbers(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_transcription_form_refuses_non_finite_temperature():
    for text in ("nan", "inf", "-Infinity"):
        with pytest.raises(ValueError, match="temperature"):
            TranscriptionRequest(temperature=text)


# ------------------------------------------------------------------------------------------
# Nesting depth
# ------------------------------------------------------------------------------------------
def nested(depth: int) -> str:
    """JSON of ``depth`` nested lists around a 1: ``[[...[1]...]]``."""
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("path, template, param", [
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "A"}], "max_tokens": 1, '
                             '"chat_template_kwargs": {"deep": %s}}', "chat_template_kwargs"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "A", "deep": %s}]}], "max_tokens": 1}', "messages"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "A"}], "max_tokens": 1, '
                             '"tools": [{"type": "function", "function": {"parameters": %s}}]}', "tools"),
    ("/v1/completions", '{"model": "%s", "prompt": "A", "max_tokens": 1, "extra": %s}', "extra"),
    ("/tokenize", '{"model": "%s", "messages": [{"role": "user", "content": "A"}], '
                  '"chat_template_kwargs": {"deep": %s}}', "chat_template_kwargs"),
])
def test_deep_json_is_a_400_naming_the_field(server, path, template, param):
    with HealthPoller(server) as health:
        for depth in (MAX_JSON_DEPTH, 490):
            err = assert_error(post(server, path, template % (MODEL, nested(depth))), 400, param)
            assert f"at most {MAX_JSON_DEPTH}" in err["message"], err
    health.assert_answered_within()


def test_json_too_deep_to_parse_is_a_400(server):
    with HealthPoller(server) as health:
        r = post(server, "/v1/chat/completions", '{"model": "x", "messages": %s}' % nested(100_000))
        err = assert_error(r, 400)
    health.assert_answered_within()
    assert "nested too deeply" in err["message"], err


def test_shallow_extra_json_is_served(server):
    body = '{"model": "%s", "prompt": "A", "max_tokens": 1, "extra": %s}' % (MODEL, nested(MAX_JSON_DEPTH - 2))
    assert post(server, "/v1/completions", body).status_code == 200


def test_a_recursion_error_anywhere_is_a_400():
    assert to_openai_error(RecursionError("maximum recursion depth exceeded")).status_code == 400
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/deep")
    async def deep() -> None:
        raise RecursionError("maximum recursion depth exceeded")

    r = TestClient(app, raise_server_exceptions=False).get("/deep")
    err = assert_error(r, 400)
    assert "nested too deeply" in err["message"]


# ------------------------------------------------------------------------------------------
# Request ids
# ------------------------------------------------------------------------------------------
BAD_IDS = ["a\nb", "a\r\nINFO forged line", "victim#1", "", "x" * 129, "a b", "ünï", "a/b", "a\x00b"]


@pytest.mark.parametrize("request_id", BAD_IDS)
@pytest.mark.parametrize("path, make", [("/v1/completions", completion), ("/v1/chat/completions", chat)])
def test_bad_request_id_field_is_400(server, request_id, path, make):
    err = assert_error(post(server, path, make(request_id=request_id)), 400, "request_id")
    assert "\n" not in err["message"] and request_id not in err["message"] or request_id == "", err


@pytest.mark.parametrize("header", ["victim#1", "x" * 129, "a b", "a;b", "a\tb"])
@pytest.mark.parametrize("path, make", [("/v1/completions", completion), ("/v1/chat/completions", chat)])
def test_bad_x_request_id_header_is_400(server, header, path, make):
    err = assert_error(post(server, path, make(), headers={"X-Request-Id": header}), 400, "request_id")
    assert "X-Request-Id" in err["message"], err


def test_good_request_ids_are_served(server):
    good = "Req-1.a_b:c-" + "x" * 116
    assert len(good) == 128
    r = post(server, "/v1/completions", completion(request_id=good))
    assert r.status_code == 200 and r.json()["id"] == good, r.text
    r = post(server, "/v1/chat/completions", chat(), headers={"X-Request-Id": "hdr-1.2:3_x"})
    assert r.status_code == 200 and r.json()["id"] == "hdr-1.2:3_x", r.text
    assert httpx.get(server.url + "/health", headers={"X-Request-Id": "a b"}).status_code == 200


# ------------------------------------------------------------------------------------------
# CORS
# ------------------------------------------------------------------------------------------
def test_default_cors_sends_no_credentials_to_any_origin(server):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": EVIL_ORIGIN})
    assert r.status_code == 200
    assert r.headers.get("access-control-allow-origin") == "*"   # not the reflected origin
    assert "access-control-allow-credentials" not in r.headers
    pre = httpx.options(server.url + "/v1/chat/completions",
                        headers={"Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200
    assert pre.headers.get("access-control-allow-origin") == "*"
    assert "access-control-allow-credentials" not in pre.headers


def test_credentials_with_a_wildcard_origin_is_a_startup_error():
    with pytest.raises(ValueError, match="--allow-credentials.*--allowed-origins"):
        check_serve_args(make_serve_namespace(allow_credentials=True))
    with pytest.raises(ValueError, match="--allow-credentials"):
        check_serve_args(make_serve_namespace(allow_credentials=True, allowed_origins=["https://a.example", "*"]))
    check_serve_args(make_serve_namespace(allow_credentials=True, allowed_origins=["https://a.example"]))
    ns = make_serve_namespace()
    assert ns.allowed_origins == ["*"] and ns.allow_credentials is False
    assert ns.allowed_methods == ["*"] and ns.allowed_headers == ["*"]


# ------------------------------------------------------------------------------------------
# The request log line
# ------------------------------------------------------------------------------------------
def test_sampling_params_repr_is_bounded():
    params = SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    text = repr(params)
    assert len(text) < 1500, len(text)
    assert f"<{MAX_STOP_STRINGS} items>" in text and f"<{MAX_STOP_TOKEN_IDS} items>" in text
    assert f"<{MAX_STOP_STRING_CHARS} chars>" in text
    assert str(params) == text
    assert "stop=['a', 'b']" in repr(SamplingParams(stop=["a", "b"]))   # short values in full


def test_request_log_line_stays_short(server, caplog):
    body = completion(stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                      stop_token_ids=list(range(10_000, 10_000 + MAX_STOP_TOKEN_IDS)))
    assert len(json.dumps(body)) > 250_000
    client = server.engine_client
    client.log_requests = True
    try:
        with caplog.at_level(logging.INFO, logger="chorus.async_llm"):
            r = post(server, "/v1/completions", body)
    finally:
        client.log_requests = False
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "Added request" in rec.getMessage()]
    assert lines, [rec.getMessage() for rec in caplog.records]
    assert all(len(line) < 2000 for line in lines), [len(line) for line in lines]
