"""Every route's request schema, fuzzed: hypothesis (derandomized, a bounded number of examples) builds
bodies from the pydantic models of ``engine/server/protocol.py`` (a valid body, some fields set to values
a client would send, then up to two fields dropped, set to an edge value of their type or to any JSON
value), the multipart audio form, the adapter load/unload bodies, tokenize/detokenize, and raw bytes that
are not JSON; a deterministic sweep sets each field of each body, one at a time, to each edge value of
its type and to values of other types. One in-process server serves a tiny LLaVA (text and images) with
runtime adapters and a tiny random Whisper.

Asserted for every example: no 5xx (in-band stream errors included), an answer within
``REQUEST_TIMEOUT_S``; afterwards the server still answers a normal request and holds nothing (the
/metrics gauges ``benchmarks/soak.py`` checks)."""

from __future__ import annotations

import base64
import json
import types
import typing
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from typing import Any, Optional, Union

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import engine.server.app as app_module
from benchmarks.soak import IDLE_GAUGES, make_clips, make_images, parse_gauges, write_random_adapters
from engine.async_llm import AsyncLLM
from engine.server.app import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from engine.server.args import engine_processes, make_serve_namespace, transcription_engine_kwargs
from engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeChatRequest, TokenizeCompletionRequest, TranscriptionRequest)
from tests.server.conftest import start_server, wait_until

MODEL = "fuzz-llava"
WHISPER = "fuzz-whisper"
ADAPTER = "fuzz-lora"
REQUEST_TIMEOUT_S = 30.0
"""An answer later than this is a hang."""
MAX_MODEL_LEN = 96
"""Small, so that a valid body without max_tokens generates little."""
FUZZ = settings(derandomize=True, max_examples=40, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


# ----------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    from tests.audio.whisper_reference import build_tiny_random_whisper
    from tests.vision.conftest import build_tiny_llava

    root = tmp_path_factory.mktemp("fuzz")
    llava = build_tiny_llava(root / "llava")
    adapter_dir = write_random_adapters(llava, root / "adapters", 1)["soak-lora-0"]
    try:
        whisper = {"transcription_model": str(build_tiny_random_whisper(root, max_target_positions=48)),
                   "transcription_served_model_name": [WHISPER]}
    except pytest.skip.Exception:   # no real tiny.en tokenizer to copy: the audio routes answer 400s
        whisper = {}
    common = dict(kv_cache_space=0.05, max_num_seqs=8, max_logprobs=5)
    args = make_serve_namespace(**whisper, **common)
    with ExitStack() as stack:
        if whisper:
            # NOTE: start_server builds one engine; build_app gets the Whisper one through this patch.
            client = AsyncLLM.from_engine_args(log_requests=False, engine_process=engine_processes(args)[1],
                                               **transcription_engine_kwargs(args))
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(app_module, "build_app", partial(app_module.build_app, transcription_client=client))
        srv = start_server(str(llava), served_model_name=[MODEL], max_model_len=MAX_MODEL_LEN,
                           dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                           allow_runtime_lora_updating=True,
                           lora_modules=[f"{ADAPTER}={adapter_dir}"], limit_mm_per_prompt={"image": 2},
                           engine_process=engine_processes(args)[0], **whisper, **common)
    http = httpx.Client(base_url=srv.url, timeout=REQUEST_TIMEOUT_S)
    yield types.SimpleNamespace(srv=srv, http=http, root=root, llava=llava, adapter_dir=adapter_dir)
    http.close()
    srv.stop()


def check(resp: httpx.Response) -> None:
    """No 5xx, also not inside a 200 stream (an in-band error event)."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:2000])
    if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                code = json.loads(line[len("data: "):]).get("error", {}).get("code")
                assert not isinstance(code, int) or code < 500, line


def post_json(env, path: str, body: Any) -> httpx.Response:
    resp = env.http.post(path, content=json.dumps(body, allow_nan=True),
                         headers={"Content-Type": "application/json"})
    check(resp)
    return resp


# ----------------------------------------------------------------------------------------
# Strategies: pydantic model -> bodies
# ----------------------------------------------------------------------------------------
EDGE_INTS = [0, 1, -1, 2, 7, 2 ** 31, -2 ** 31, 2 ** 63, -2 ** 63 - 1, 10 ** 30]
EDGE_FLOATS = [0.0, -0.0, 1e-300, -1.0, 0.5, 2.0, 1e308, float("inf"), float("-inf"), float("nan")]
EDGE_TEXT = ["", " ", "\x00", "<|im_start|>", "<image>", "\ud800", "é" * 3, "a" * 600, "{{ raise }}",
             "{% for x in y %}", "data:image/png;base64,AAAA", "file:///etc/passwd", MODEL, ADAPTER, WHISPER]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from(EDGE_INTS),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                         st.sampled_from(EDGE_TEXT))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
small_ints = st.one_of(st.integers(-3, 8), st.sampled_from(EDGE_INTS))
texts = st.one_of(st.text(max_size=40), st.sampled_from(EDGE_TEXT))


def _image_part() -> st.SearchStrategy:
    png = base64.b64encode(make_images(1, 0)[0]).decode()
    urls = st.sampled_from([f"data:image/png;base64,{png}", "data:image/png;base64,",
                            "data:image/png;base64,!!!",
                            f"data:image/png;base64,{png[:40]}", "data:text/plain;base64,aGVsbG8=",
                            "file:///etc/passwd", "ftp://x/y.png", "http://[::1", "", "not a url"])
    return st.one_of(st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": urls}, optional={"detail": texts})}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(urls, json_values)}),
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, json_values)}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "input_audio", "video_url", "refusal", ""])},
                              optional={"text": texts}),
        json_values)


content_parts = st.lists(_image_part(), max_size=3)
FIELD_OVERRIDES: dict[str, st.SearchStrategy] = {
    "model": st.one_of(st.none(), st.sampled_from([MODEL, ADAPTER, WHISPER, "nope"]), texts),
    "max_tokens": small_ints, "max_completion_tokens": small_ints, "n": small_ints, "best_of": small_ints,
    "logprobs": st.one_of(st.booleans(), small_ints), "top_logprobs": small_ints,
    "prompt_logprobs": small_ints,
    "min_tokens": small_ints, "top_k": small_ints, "priority": small_ints,
    "prompt": st.one_of(texts, st.lists(texts, max_size=3), st.lists(small_ints, max_size=5),
                        st.lists(st.lists(small_ints, max_size=4), max_size=3)),
    "tokens": st.lists(st.one_of(st.integers(-5, 400), st.sampled_from(EDGE_INTS)), max_size=6),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", ""]), texts)},
        optional={"content": st.one_of(st.none(), texts, content_parts), "name": texts}), max_size=3),
    "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=3)),
    "stop_token_ids": st.lists(st.one_of(st.integers(-5, 400), st.sampled_from(EDGE_INTS)), max_size=3),
    "chat_template": st.one_of(st.none(), st.sampled_from(["{{ messages[0]['content'] }}", "{{ 1/0 }}",
                                                           "{% if %}", "{{ raise_exception('x') }}"]), texts),
    "request_id": st.one_of(st.none(), st.sampled_from(["fixed-id", ""]), texts),
}


def field_strategy(annotation: Any) -> st.SearchStrategy:
    """Values of a pydantic field's type, edge values first in mind."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return st.one_of(*[field_strategy(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(field_strategy(args[0]) if args else json_values, max_size=3)
    if origin is dict:
        return st.dictionaries(texts, field_strategy(args[1]) if len(args) > 1 else json_values, max_size=3)
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return small_ints
    if annotation is float:
        return st.one_of(st.floats(-3, 3), st.sampled_from(EDGE_FLOATS))
    if annotation is str:
        return texts
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):   # a nested object
        hints = typing.get_type_hints(annotation)
        fields = {n: field_strategy(hints[n]) for n in annotation.model_fields}
        return st.fixed_dictionaries({}, optional=fields)
    return json_values


def plausible_message() -> st.SearchStrategy:
    png = "data:image/png;base64," + base64.b64encode(make_images(1, 1)[0]).decode()
    text = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
    image = st.just({"type": "image_url", "image_url": {"url": png}})
    parts = st.lists(st.one_of(text, image), min_size=1, max_size=3)
    return st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                  "content": st.one_of(st.text(max_size=30), parts)})


PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from([MODEL, ADAPTER]),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), min_size=1, max_size=3),
                        st.lists(st.integers(0, 300), min_size=1, max_size=8),
                        st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=4), min_size=1,
                                 max_size=2)),
    "messages": st.lists(plausible_message(), min_size=1, max_size=3),
    "tokens": st.lists(st.integers(0, 300), max_size=8),
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "n": st.integers(1, 3),
    "best_of": st.integers(1, 3), "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2 ** 31),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "top_logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 5), "echo": st.booleans(),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 4), "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(), "priority": st.integers(-2, 2), "user": st.text(max_size=8),
    "suffix": st.text(max_size=8), "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(), "return_token_strs": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=5), json_scalars, max_size=2),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tool_choice": st.sampled_from(["none", "auto"]),
}
"""Values a client would send: with them most examples reach the engine."""


def model_bodies(model: type[BaseModel], base: dict[str, Any], logprobs: Optional[st.SearchStrategy] = None
                 ) -> st.SearchStrategy:
    """JSON bodies for ``model``: ``base`` (a valid body), plus up to 5 of its fields set to plausible
    values, then up to 2 fields fuzzed: dropped, set to an edge value of the field's type (pydantic
    annotation), or to any JSON value."""
    hints = typing.get_type_hints(model)
    names = sorted(model.model_fields)
    plausible = {n: PLAUSIBLE[n] for n in names if n in PLAUSIBLE}
    if logprobs is not None:
        plausible["logprobs"] = logprobs

    @st.composite
    def bodies(draw: Any) -> dict[str, Any]:
        body = dict(base)
        for name in draw(st.lists(st.sampled_from(sorted(plausible)), max_size=5, unique=True)):
            body[name] = draw(plausible[name])
        for name in draw(st.lists(st.sampled_from(names + ["unknown_field"]), max_size=2, unique=True)):
            how = draw(st.sampled_from(["drop", "typed", "typed", "any"]))
            if how == "drop":
                body.pop(name, None)
            elif how == "any" or name not in hints:
                body[name] = draw(json_values)
            else:
                typed = FIELD_OVERRIDES[name] if name in FIELD_OVERRIDES else field_strategy(hints[name])
                body[name] = draw(typed)
        return body
    return bodies()


# ----------------------------------------------------------------------------------------
# Routes
# ----------------------------------------------------------------------------------------
BASE_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@FUZZ
@given(body=model_bodies(CompletionRequest, {"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                         logprobs=st.integers(0, 5)))
def test_fuzz_completions(fuzz_env, body):
    post_json(fuzz_env, "/v1/completions", body)


@FUZZ
@given(body=model_bodies(ChatCompletionRequest, BASE_CHAT, logprobs=st.booleans()))
def test_fuzz_chat(fuzz_env, body):
    post_json(fuzz_env, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=30)
@given(path_body=st.one_of(
    st.tuples(st.just("/tokenize"),
              model_bodies(TokenizeCompletionRequest, {"model": MODEL, "prompt": "Hello"})),
    st.tuples(st.just("/tokenize"), model_bodies(TokenizeChatRequest, {"messages": BASE_CHAT["messages"]})),
    st.tuples(st.just("/detokenize"),
              model_bodies(DetokenizeRequest, {"model": MODEL, "tokens": [1, 2, 3]}))))
def test_fuzz_tokenize_detokenize(fuzz_env, path_body):
    post_json(fuzz_env, *path_body)


@settings(FUZZ, max_examples=25)
@given(route=st.sampled_from(["load", "unload"]),
       body=st.fixed_dictionaries({}, optional={
           "lora_name": st.one_of(st.sampled_from([ADAPTER, "fuzz-new", MODEL, WHISPER, ""]), texts,
                                  json_values),
           "lora_path": st.one_of(st.sampled_from(["ADAPTER_DIR", "MODEL_DIR", "/", "/etc/passwd",
                                                   "/nonexistent",
                                                   "", "relative/path"]), texts, json_values),
           "base_model_name": st.one_of(st.none(), texts)}))
def test_fuzz_lora_load_unload(fuzz_env, route, body):
    paths = {"ADAPTER_DIR": str(fuzz_env.adapter_dir), "MODEL_DIR": str(fuzz_env.llava)}
    if isinstance(body.get("lora_path"), str):
        body["lora_path"] = paths.get(body["lora_path"], body["lora_path"])
    post_json(fuzz_env, f"/v1/{route}_lora_adapter", body)


AUDIO_EDGES = st.one_of(st.sampled_from(["", "0", "1", "-1", "true", "false", "nan", "inf", "1e309", "json",
                                         "text", "srt", "vtt", "verbose_json", "segment", "word", "en",
                                         "english", "xx",
                                         WHISPER, MODEL, ADAPTER]), st.text(max_size=12))
AUDIO_PLAUSIBLE = {"model": st.just(WHISPER), "language": st.sampled_from(["en", "english"]),
                   "prompt": st.text(max_size=20), "temperature": st.sampled_from(["0", "0.5"]),
                   "response_format": st.sampled_from(["json", "text", "verbose_json", "srt", "vtt"]),
                   "timestamp_granularities[]": st.just("segment"),
                   "stream": st.sampled_from(["true", "false"])}


@st.composite
def audio_forms(draw: Any) -> dict[str, str]:
    """Form fields: a valid form, up to 4 plausible fields, then up to 2 fields set to edge strings."""
    fields = {"model": WHISPER}
    for name in draw(st.lists(st.sampled_from(sorted(AUDIO_PLAUSIBLE)), max_size=4, unique=True)):
        fields[name] = draw(AUDIO_PLAUSIBLE[name])
    names = sorted(AUDIO_PLAUSIBLE) + sorted(TranscriptionRequest.model_fields) + ["unknown"]
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        fields[name] = draw(AUDIO_EDGES)
    return fields


@settings(FUZZ, max_examples=30)
@given(route=st.sampled_from(["transcriptions", "translations"]), fields=audio_forms(),
       file=st.one_of(st.just("wav"), st.just("wav"), st.none(),
                      st.sampled_from(["truncated", "empty", "text"]),
                      st.binary(max_size=64)))
def test_fuzz_audio_form(fuzz_env, route, fields, file):
    wav = make_clips(1)[0]
    data = {"wav": wav, "truncated": wav[:60], "empty": b"", "text": b"not audio"}.get(file, file) \
        if not isinstance(file, bytes) else file
    files = {"file": ("clip.wav", data, "audio/wav")} if data is not None else None
    if files is None:   # a multipart body with text fields only
        files = {"dummy": (None, "x")}
    resp = fuzz_env.http.post(f"/v1/audio/{route}", data=fields, files=files)
    check(resp)


@settings(FUZZ, max_examples=30)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                             "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/audio/transcriptions"]),
       content=st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{", b"[]", b"null", b"1e999", b'"x"',
                                                                  b'{"prompt": "a"' + b" " * 10,
                                                                  b"\xff\xfe"])),
       content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data",
                                     "multipart/form-data; boundary=x", "",
                                     "application/x-www-form-urlencoded"]))
def test_fuzz_raw_bodies(fuzz_env, path, content, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    check(fuzz_env.http.post(path, content=content, headers=headers))


SWEEP_EDGES: dict[Any, list] = {
    int: [-1, 2 ** 63, -2 ** 63 - 1, 10 ** 30],
    float: [-1.0, 1e308, float("nan"), float("-inf")],
    str: ["", "\x00", "\ud800", "a" * 5000],
    list: [[], [None], [[]]],
    dict: [{"": None}],
}
WRONG_TYPES = [None, "x", {}, True, 2 ** 64]


def edge_values(annotation: Any, default: Any = None) -> list:
    """Edge values of a field's type (each member of a union), then values of other types; not the
    field's default (the base body's behaviour)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        out = [v for a in typing.get_args(annotation) for v in edge_values(a, default)]
    else:
        out = list(SWEEP_EDGES.get(origin or annotation, []))
    out += [v for v in WRONG_TYPES if all(v is not o for o in out)]
    seen: list = []
    for v in out:   # once each, and not the default
        if not any(v is s or (type(v) is type(s) and v == s) for s in seen + [default]):
            seen.append(v)
    return seen


@pytest.mark.parametrize("path, model, base", [
    ("/v1/completions", CompletionRequest, {"model": MODEL, "prompt": "Hello", "max_tokens": 1}),
    ("/v1/chat/completions", ChatCompletionRequest, {**BASE_CHAT, "max_tokens": 1}),
    ("/tokenize", TokenizeCompletionRequest, {"model": MODEL, "prompt": "Hello"}),
    ("/tokenize", TokenizeChatRequest, {"messages": BASE_CHAT["messages"]}),
    ("/detokenize", DetokenizeRequest, {"model": MODEL, "tokens": [1, 2, 3]}),
    ("/v1/load_lora_adapter", LoadLoRAAdapterRequest, {"lora_name": "sweep", "lora_path": "/nonexistent"}),
    ("/v1/unload_lora_adapter", UnloadLoRAAdapterRequest, {"lora_name": "sweep"}),
], ids=["completions", "chat", "tokenize", "tokenize-chat", "detokenize", "load-lora", "unload-lora"])
def test_every_field_at_its_edges(fuzz_env, path, model, base):
    """Deterministic sweep next to the random search: each field of the body, one at a time, at each edge
    value of its type and at values of other types."""
    hints = typing.get_type_hints(model)
    cases = [(name, value) for name, f in sorted(model.model_fields.items())
             for value in edge_values(hints[name], f.default)]

    def run(case: tuple[str, Any]) -> Optional[str]:
        name, value = case
        try:
            post_json(fuzz_env, path, {**base, name: value})
        except AssertionError as e:
            return f"{name}={str(value)[:40]!r}: {str(e)[:300]}"
        return None
    with ThreadPoolExecutor(8) as pool:   # validation is the point, not ordering: 8 at a time
        failures = [f for f in pool.map(run, cases) if f]
    assert not failures, "\n".join(failures)


def test_zz_still_serves_and_holds_nothing(fuzz_env):
    """Runs after the fuzz tests (module order): a normal request works and, once the adapters the fuzz
    loaded are unloaded, the server holds nothing."""
    http = fuzz_env.http
    http.post("/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(fuzz_env.adapter_dir)})
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                              "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1, resp.text
    resp = http.post("/v1/chat/completions", json={"model": ADAPTER, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200, resp.text
    for card in http.get("/v1/models").json()["data"]:
        if card["id"] not in (MODEL, WHISPER):
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": card["id"]}).status_code == 200

    def idle() -> bool:
        gauges = parse_gauges(http.get("/metrics").text)
        return all(gauges.get(g, 0.0) == 0 for g in IDLE_GAUGES)
    assert wait_until(idle, timeout_s=10), {g: v for g, v in parse_gauges(http.get("/metrics").text).items()
                                            if g in IDLE_GAUGES and v}
