"""Every error case returns OpenAI's body with the right status, and the server keeps serving;
an engine fault turns into 503s and a failed /health."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import start_server, wait_until

MODEL = "tiny-llama"
KEY = "sk-chorus-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), served_model_name=[MODEL], max_model_len=64, api_key=KEY,
                       max_request_body_bytes=20_000, max_logprobs=5)
    yield srv
    srv.stop()


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


def post(server, path, body, headers=AUTH, **kw):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def test_api_key_guards_every_route_but_the_open_ones(server):
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "A"}, headers={}), 401)
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    # Only the health and monitoring routes stay open (tests/security/test_routes.py walks them all).
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "A"}), 401)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "A"}, headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    ok = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == MODEL


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": "A", "max_tokens": "abc"}, "max_tokens"),      # pydantic type error
    ({"model": MODEL}, "prompt"),                                              # missing field
    ({"model": MODEL, "prompt": "A", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "A", "top_p": 2}, "top_p"),
    ({"model": MODEL, "prompt": "A", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "A", "n": 100_000}, "n"),                        # more than max_num_seqs
    ({"model": MODEL, "prompt": "A", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "A", "logprobs": 6}, "logprobs"),                # > --max-logprobs
    ({"model": MODEL, "prompt": "A", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [10 ** 9]}, "prompt_token_ids"),
    ({"model": MODEL, "prompt": "word " * 100}, "prompt"),                       # longer than max_model_len
    ({"model": MODEL, "prompt": "A", "max_tokens": 100_000}, "max_tokens"),      # prompt + max_tokens too long
    ({"model": MODEL, "prompt": "A", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"model": MODEL, "prompt": "A", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_400(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "A"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "A"}], "logprobs": True, "top_logprobs": 9},
     "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 100}]}, "prompt"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "A"}], "max_completion_tokens": -1},
     "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "A"}],
      "response_format": {"type": "xml"}}, "response_format"),
    ({"model": MODEL,
      "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
])
def test_chat_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_invalid_json_is_400_not_422(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400)


def test_unknown_model_404(server):
    for path, body in [("/v1/completions", {"model": "nope", "prompt": "A"}),
                       ("/v1/chat/completions",
                        {"model": "nope", "messages": [{"role": "user", "content": "A"}]})]:
        err = assert_error(post(server, path, body), 404, "model")
        assert err == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                       "param": "model", "code": 404}
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="A")
    assert_error(httpx.get(server.url + "/no/such/route", headers=AUTH), 404)
    assert_error(httpx.get(server.url + "/no/such/route"), 401)   # without the key no route is revealed


def test_body_too_large_413(server):
    big = {"model": MODEL, "prompt": "x" * 30_000}
    assert_error(post(server, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: counted while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 413)


def test_server_still_serves_after_errors(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "A", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    chunked_ok = httpx.post(server.url + "/v1/completions", timeout=30,
                            content=iter([json.dumps({"model": MODEL, "prompt": "A",
                                                      "max_tokens": 2}).encode()]),
                            headers={**AUTH, "Content-Type": "application/json"})
    assert chunked_ok.status_code == 200


def test_engine_fault_gives_503_and_unhealthy(server):
    """Runs last in this module: it kills the engine loop."""
    body = {"model": MODEL, "prompt": "A", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"]
        server.engine_client.inject_fault()
        rest = [line for line in lines if line.startswith("data: ")]
    # The in-flight stream ends with an in-band error event, then [DONE].
    assert rest[-1] == "data: [DONE]"
    assert any('"error"' in line and "503" in line for line in rest), rest[-3:]
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503)
    assert_error(httpx.get(server.url + "/health"), 503)
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "A"}), 503)
    assert_error(post(server, "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": "A"}]}), 503)
    assert server.metric("chorus:engine_healthy") == 0.0
