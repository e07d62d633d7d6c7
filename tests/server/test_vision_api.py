"""Images over /v1/chat/completions with a tiny LLaVA (float32, CPU): the reply equals offline
``LLM.generate`` with the same image and rendered prompt, streaming works, every bad image or part is
a 400 saying what was wrong (the server keeps serving, nothing leaks), slow downloads do not stall
other requests, and /metrics counts the encoder cache.

URLs are served by a ``http.server`` on 127.0.0.1 in a thread; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.server.args import add_serve_args, engine_kwargs
from tests.server.conftest import start_server, wait_until
from tests.server.test_errors import assert_error
from tests.vision.conftest import build_tiny_llava, make_image

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")   # the bomb cases

MODEL = "tiny-llava"
MAX_TOKENS = 6
FETCH_TIMEOUT_S = 0.5
SLOW_RESPONSE_S = 2.0
MAX_IMAGE_BYTES = 50_000
QUESTION = "What is in the picture?"


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width_px: int, height_px: int) -> bytes:
    """A PNG that is only a header claiming ``width_px`` x ``height_px`` (no pixel data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


IMAGE = make_image(64, 48, 0)
OTHER_IMAGE = make_image(40, 72, 1)
IMAGE_PNG = png_bytes(IMAGE)
JPEG = io.BytesIO()
make_image(64, 64, 2).save(JPEG, "JPEG")


# ----------------------------------------------------------------------------------------
# A local media server
# ----------------------------------------------------------------------------------------
class MediaServer:
    """127.0.0.1 http server: /img.png, /missing (404), /slow (answers after SLOW_RESPONSE_S),
    /big (more than MAX_IMAGE_BYTES, no Content-Length), /random (not an image)."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.hits[self.path] = owner.hits.get(self.path, 0) + 1
                try:
                    if self.path == "/img.png":
                        self._send(IMAGE_PNG)
                    elif self.path == "/slow":
                        time.sleep(SLOW_RESPONSE_S)
                        self._send(IMAGE_PNG)
                    elif self.path == "/big":
                        self.send_response(200)
                        self.send_header("Content-Type", "image/png")
                        self.end_headers()
                        self.wfile.write(IMAGE_PNG + os.urandom(MAX_IMAGE_BYTES))
                    elif self.path == "/random":
                        self._send(os.urandom(1000))
                    else:
                        self.send_error(404)
                except (BrokenPipeError, ConnectionResetError):   # the client gave up (timeout, too big)
                    pass

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ----------------------------------------------------------------------------------------
# Fixtures: one LLaVA server, one offline LLaVA for references, one text-only server
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def media():
    srv = MediaServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "img.png").write_bytes(IMAGE_PNG)
    (root / "outside.png").write_bytes(IMAGE_PNG)
    return allowed


@pytest.fixture(scope="module")
def server(llava_dir, media_dir):
    srv = start_server(str(llava_dir), served_model_name=[MODEL], dtype="float32", device="cpu",
                       max_model_len=256, max_num_seqs=8, limit_mm_per_prompt={"image": 2},
                       allowed_local_media_path=str(media_dir), allow_private_media_urls=True)
    # Test knobs (no flags for them): a short download timeout and a small size limit.
    mm_config = srv.engine_client.processor.mm_config
    mm_config.media_fetch_timeout_s = FETCH_TIMEOUT_S
    mm_config.max_image_bytes = MAX_IMAGE_BYTES
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(llava_dir):
    return LLM(str(llava_dir), device="cpu", dtype="float32", max_num_seqs=8)


@pytest.fixture(scope="module")
def text_server(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=128)
    yield srv
    srv.stop()


def image_message(*urls: str, text: str = QUESTION) -> list[dict]:
    """One user message: the images (text " and " between two), then ``text``."""
    parts = []
    for i, url in enumerate(urls):
        if i:
            parts.append({"type": "text", "text": " and "})
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat(srv, messages, timeout_s: float = 30, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **kw}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=timeout_s)


def offline_reference(offline: LLM, images) -> tuple[str, int]:
    """(text, prompt tokens) of LLM.generate on the rendered prompt of ``image_message`` with ``images``."""
    images = images if isinstance(images, list) else [images]
    content = []
    for i in range(len(images)):
        content += [{"type": "text", "text": " and "}] * bool(i) + [{"type": "image"}]
    content.append({"type": "text", "text": QUESTION})
    prompt = offline.get_tokenizer().apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                         add_generation_prompt=True)
    out = offline.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


def assert_idle(srv) -> None:
    """Nothing left over: no requests, no KV blocks, no referenced encoder-cache entries."""
    core = srv.engine_client._transport.core
    assert wait_until(lambda: not core.scheduler.has_unfinished_requests())
    assert wait_until(lambda: srv.engine_client.get_stats().num_running_reqs == 0)
    stats = srv.engine_client.get_stats()
    assert stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    ecm = core.scheduler.encoder_cache_manager
    assert all(not refs for refs in ecm.cached.values())
    assert ecm.num_freeable_slots == ecm.cache_size
    assert not srv.engine_client._states and not srv.engine_client.output_processor.parents


# ----------------------------------------------------------------------------------------
# Good requests
# ----------------------------------------------------------------------------------------
def test_chat_with_image_equals_offline_generate(server, offline, media, media_dir):
    want_text, want_prompt_tokens = offline_reference(offline, IMAGE)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=image_message(data_url(IMAGE_PNG)),
                                          max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == want_text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == want_prompt_tokens   # the image's placeholders, expanded
    assert resp.usage.completion_tokens == MAX_TOKENS
    # The same pixels by http(s) URL, by file:// URL under --allowed-local-media-path, and in the
    # short form {"image_url": "<url>"}: the same reply.
    for url in (media.url + "/img.png", (media_dir / "img.png").as_uri()):
        r = chat(server, image_message(url))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want_text
    short = [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(IMAGE_PNG)},
                                          {"type": "text", "text": QUESTION}]}]
    assert chat(server, short).json()["choices"][0]["message"]["content"] == want_text
    # A different image: a different reply (the image reaches the model).
    other = chat(server, image_message(data_url(png_bytes(OTHER_IMAGE))))
    assert other.json()["choices"][0]["message"]["content"] == offline_reference(offline, OTHER_IMAGE)[0]


def test_two_images_and_streaming(server, offline):
    want_text, _ = offline_reference(offline, [IMAGE, OTHER_IMAGE])
    urls = [data_url(IMAGE_PNG), data_url(png_bytes(OTHER_IMAGE))]
    r = chat(server, image_message(*urls))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want_text
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=image_message(*urls), max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_slow_download_does_not_stall_other_requests(server, media):
    """A download waiting on a slow host runs in the media pool: a text request (streamed) completes
    while it waits. (On the event loop, the text request would wait for the download.)"""
    mm_config = server.engine_client.processor.mm_config
    mm_config.media_fetch_timeout_s = SLOW_RESPONSE_S * 3   # this time the slow host is waited for
    before = media.hits.get("/slow", 0)
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(chat, server, image_message(media.url + "/slow"))
            assert wait_until(lambda: media.hits.get("/slow", 0) > before, timeout_s=10)
            t0 = time.monotonic()
            r = chat(server, [{"role": "user", "content": "Hello"}], stream=True)
            text_s = time.monotonic() - t0
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert not slow.done(), f"the text request took {text_s:.2f} s, as long as the slow download"
            assert slow.result().status_code == 200
    finally:
        mm_config.media_fetch_timeout_s = FETCH_TIMEOUT_S


# ----------------------------------------------------------------------------------------
# Bad requests: 400 with the reason; the server keeps serving and nothing leaks
# ----------------------------------------------------------------------------------------
BAD_IMAGES = [
    ("random bytes", lambda m, d: data_url(os.urandom(500)), "not an image in a supported format"),
    ("truncated PNG", lambda m, d: data_url(png_bytes(make_image(200, 200, 5))[:2000]), "truncated or corrupt"),
    ("truncated JPEG", lambda m, d: data_url(JPEG.getvalue()[:400], "image/jpeg"), "truncated or corrupt"),
    ("zero bytes", lambda m, d: "data:image/png;base64,", "the image is empty (0 bytes)"),
    ("zero size", lambda m, d: data_url(png_header(0, 0)), "starts like a PNG image but could not be read"),
    ("decompression bomb", lambda m, d: data_url(png_header(100_000, 100_000)), "too many pixels"),
    ("over the pixel limit", lambda m, d: data_url(png_header(10_000, 10_000)),
     "10000x10000 px = 100000000 pixels, above the limit of 50000000"),
    ("not base64", lambda m, d: "data:image/png;base64,@@@@", "not valid base64"),
    ("not an image type", lambda m, d: data_url(IMAGE_PNG, "text/plain"), "must hold an image"),
    ("URL 404", lambda m, d: m.url + "/missing", "HTTP 404"),
    ("URL not an image", lambda m, d: m.url + "/random", "not an image in a supported format"),
    ("URL too large", lambda m, d: m.url + "/big", f"larger than the limit of {MAX_IMAGE_BYTES} bytes"),
    ("URL timeout", lambda m, d: m.url + "/slow", f"timed out after {FETCH_TIMEOUT_S:g} s"),
    ("ftp scheme", lambda m, d: "ftp://127.0.0.1/img.png", "unsupported image URL 'ftp://127.0.0.1/img.png'"),
    ("plain path", lambda m, d: str(d / "img.png"), "unsupported image URL"),
    ("file outside", lambda m, d: (d.parent / "outside.png").as_uri(), "outside the allowed media directory"),
    ("file traversal", lambda m, d: d.as_uri() + "/../outside.png", "outside the allowed media directory"),
    ("file missing", lambda m, d: (d / "nope.png").as_uri(), "image file not found"),
]


@pytest.mark.parametrize("case, url_of, message", BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_bad_image_is_400(server, media, media_dir, case, url_of, message):
    err = assert_error(chat(server, image_message(url_of(media, media_dir))), 400, "messages")
    assert err["message"].startswith("An image could not be loaded: ")
    assert message in err["message"], err["message"]


BAD_PARTS = [
    ("no image_url", [{"type": "image_url"}], "messages[0].content[0]: an image_url part needs 'image_url'"),
    ("url not a string", [{"type": "image_url", "image_url": {"url": 5}}], "a non-empty string"),
    ("unknown type", [{"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}],
     "messages[0].content[0]: unsupported content part type 'video_url'; use one of text, image_url"),
    ("audio to a vision model", [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "messages[0].content[0]: this model does not take audio"),
    ("offline type", [{"type": "image_pil", "image_pil": "x"}], "only accepted by the offline LLM.chat"),
    ("no type", [{"text": "hi"}], "a content part needs a 'type'"),
    ("text without text", [{"type": "text", "text": 3}], "a text part needs 'text', a string"),
]


@pytest.mark.parametrize("case, parts, message", BAD_PARTS, ids=[c[0] for c in BAD_PARTS])
def test_malformed_part_is_400(server, case, parts, message):
    err = assert_error(chat(server, [{"role": "user", "content": parts}]), 400, "messages")
    assert message in err["message"], err["message"]


def test_more_images_than_the_limit_is_400(server, media):
    hits = media.hits.get("/img.png", 0)
    err = assert_error(chat(server, image_message(*[media.url + "/img.png"] * 3)), 400)
    assert "at most 2 image(s) per prompt, got 3 (raise --limit-mm-per-prompt)" in err["message"]
    assert media.hits.get("/img.png", 0) == hits   # refused before anything was fetched


def test_placeholder_in_text_is_400(server):
    err = assert_error(chat(server, image_message(data_url(IMAGE_PNG), text="twice <image>")), 400)
    assert "2 image placeholder(s) but 1 image(s)" in err["message"]


def test_images_to_text_only_model_is_400(text_server, media):
    hits = dict(media.hits)
    r = httpx.post(text_server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": image_message(media.url + "/img.png"), "max_tokens": 2})
    err = assert_error(r, 400, "messages")
    assert "this model does not take images" in err["message"]
    assert media.hits == hits   # nothing fetched
    r = httpx.post(text_server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                         "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_burst_of_bad_requests_leaks_nothing(server, media, media_dir, offline):
    """Every bad request at once (timeouts included), then a good one: it succeeds and the engine is
    back to idle (no requests, no KV blocks, no referenced encoder-cache entries)."""
    bodies = [image_message(url_of(media, media_dir)) for _, url_of, _ in BAD_IMAGES]
    bodies += [[{"role": "user", "content": parts}] for _, parts, _ in BAD_PARTS]
    bodies.append(image_message(*[data_url(IMAGE_PNG)] * 3))
    with ThreadPoolExecutor(8) as pool:
        statuses = [r.status_code for r in pool.map(lambda m: chat(server, m), bodies)]
    assert statuses == [400] * len(bodies)
    r = chat(server, image_message(data_url(IMAGE_PNG)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == offline_reference(offline, IMAGE)[0]
    assert httpx.get(server.url + "/health").status_code == 200
    assert_idle(server)


# ----------------------------------------------------------------------------------------
# Metrics and flags
# ----------------------------------------------------------------------------------------
def test_metrics_count_encoder_cache(server):
    def read() -> tuple[float, float]:
        return (server.metric("chorus:encoder_cache_queries_total"),
                server.metric("chorus:encoder_cache_hits_total"))

    def message(lead: str) -> list[dict]:   # text before the image: no prefix-cache hit over it
        return [{"role": "user", "content": [{"type": "text", "text": lead}, image, {"type": "text", "text": "?"}]}]

    queries, hits = read()
    image = {"type": "image_url", "image_url": {"url": data_url(png_bytes(make_image(52, 52, 9)))}}  # only here
    assert chat(server, message("First:")).status_code == 200
    assert wait_until(lambda: read() == (queries + 1, hits))   # encoded: a miss
    assert chat(server, message("Second:")).status_code == 200
    assert wait_until(lambda: read() == (queries + 2, hits + 1))   # the same pixels, cached: a hit
    assert 0.0 < server.metric("chorus:encoder_cache_usage_perc") <= 1.0
    assert_idle(server)


def test_serve_flags_reach_the_engine():
    p = add_serve_args(argparse.ArgumentParser(prog="chorus serve"))
    help_text = p.format_help()
    for flag in ("--limit-mm-per-prompt", "--allowed-local-media-path", "--max-num-encoder-input-tokens",
                 "--encoder-cache-size"):
        assert flag in help_text
    here = os.path.dirname(__file__)
    kw = engine_kwargs(p.parse_args(["--limit-mm-per-prompt", '{"image": 3}', "--allowed-local-media-path", here,
                                     "--max-num-encoder-input-tokens", "4k", "--encoder-cache-size", "8192"]))
    assert (kw["limit_mm_per_prompt"], kw["allowed_local_media_path"]) == ({"image": 3}, here)
    assert (kw["max_num_encoder_input_tokens"], kw["encoder_cache_size"]) == (4000, 8192)
    assert engine_kwargs(p.parse_args(["--limit-mm-per-prompt", "image=0"]))["limit_mm_per_prompt"] == {"image": 0}
    assert "limit_mm_per_prompt" not in engine_kwargs(p.parse_args([]))


@pytest.mark.parametrize("argv, message", [
    (["--limit-mm-per-prompt", '{"video": 1}'], "unknown modality 'video'; use one of image"),
    (["--limit-mm-per-prompt", "image=-1"], "must be an integer >= 0"),
    (["--limit-mm-per-prompt", "{image: 2}"], "is not valid JSON"),
    (["--limit-mm-per-prompt", "2"], "is not MODALITY=COUNT; use JSON like"),
    (["--allowed-local-media-path", "/no/such/dir"], "is not an existing directory"),
    (["--encoder-cache-size", "0"], "must be a positive integer"),
    (["--max-num-encoder-input-tokens", "lots"], "is not an integer"),
])
def test_bad_flag_values_are_argparse_errors(argv, message, capsys):
    p = add_serve_args(argparse.ArgumentParser(prog="chorus serve"))
    with pytest.raises(SystemExit):
        p.parse_args(argv)
    assert message in capsys.readouterr().err
