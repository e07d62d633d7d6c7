"""OpenAI's audio routes on a real server with the real Whisper tiny.en (CPU): every response format (srt
and vtt line by line), streaming events (order, deltas that add up to the done text, equal to the
non-streamed text), a 400 or 413 with OpenAI's error body for every bad upload or field, and one server
serving a tiny chat model next to Whisper: both routes answer, the ``model`` field routes, concurrent
transcriptions share engine steps, and neither errors nor client disconnects leave anything in the
Whisper engine.

Audio is made here with numpy: a gated tone that tiny.en hears as "you" (one word, a few decoding steps)
and, for long-form and disconnect tests, 40 s recordings (two 30 s windows).
"""

from __future__ import annotations

import io
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial

import httpx
import numpy as np
import openai
import pytest
import soundfile

import engine.server.app as app_module
from engine.async_llm import AsyncLLM
from engine.server.args import engine_processes, make_serve_namespace, transcription_engine_kwargs
from tests.audio.whisper_reference import AUDIO_DIR, speech_clips, whisper_dir, word_error_rate
from tests.server.conftest import parse_metric, start_server, wait_until
from tests.server.test_errors import assert_error

CHAT = "tiny-llama"
WHISPER = "whisper-1"
SAMPLE_RATE_HZ = 16000
SRT_TIME = r"\d\d:\d\d:\d\d,\d\d\d"
VTT_TIME = r"\d\d:\d\d:\d\d\.\d\d\d"


def tone(seconds: float, freq_hz: float = 220.0) -> np.ndarray:
    """A tone switched on and off twice a second (tiny.en transcribes it as "you")."""
    t = np.arange(int(SAMPLE_RATE_HZ * seconds)) / SAMPLE_RATE_HZ
    return (0.3 * np.sin(2 * np.pi * freq_hz * t) * (np.sin(2 * np.pi * 2 * t) > 0)).astype(np.float32)


def wav(samples: np.ndarray, rate_hz: int = SAMPLE_RATE_HZ, subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate_hz, format="WAV", subtype=subtype)
    return buf.getvalue()


SHORT = wav(tone(3.0))
LONG = wav(np.concatenate([tone(20.0), tone(20.0, 330.0)]))
"""Two windows, each a few tokens."""
ENDLESS = wav(np.concatenate([tone(3.0), 0.002 * np.random.default_rng(0).standard_normal(
    SAMPLE_RATE_HZ * 37).astype(np.float32)]))
"""Two windows; on the first tiny.en repeats ' .' to its 448-token limit (minutes on CPU): a request
that is idle again within seconds was aborted."""


def post_audio(server, data: bytes | None = SHORT, route: str = "transcriptions", timeout: float = 60,
               **fields) -> httpx.Response:
    files = {"file": ("audio.wav", data, "audio/wav")} if data is not None else None
    return httpx.post(f"{server.base_url}/audio/{route}", files=files, data=fields, timeout=timeout)


def sse_events(text: str) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded ("[DONE]" kept as the string)."""
    payloads = [line[len("data: "):] for line in text.split("\n\n") if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def whisper_stats(server):
    return server.app.state.serving.transcription.engine_client.get_stats()


def assert_whisper_idle(server, timeout_s: float = 15.0) -> None:
    """No running or waiting request and no KV block held in the Whisper engine."""
    def idle() -> bool:
        s = whisper_stats(server)
        return s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0
    assert wait_until(idle, timeout_s), whisper_stats(server)


@pytest.fixture(scope="module")
def duo(tiny_llama_dir):
    """One server: the tiny llama as chat model, Whisper tiny.en as --transcription-model (served as
    whisper-1), each engine with its own KV cache, run as ``chorus serve`` runs them on a CPU (both engine
    loops in threads of the server's process)."""
    whisper = str(whisper_dir("tiny.en"))
    args = make_serve_namespace(transcription_model=whisper, transcription_served_model_name=[WHISPER],
                                kv_cache_space=0.5, max_num_seqs=16)
    client = AsyncLLM.from_engine_args(log_requests=False, engine_process=engine_processes(args)[1],
                                       **transcription_engine_kwargs(args))
    with ExitStack() as stack:
        # NOTE: start_server builds one engine; build_app gets the Whisper one through this patch.
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setattr(app_module, "build_app", partial(app_module.build_app, transcription_client=client))
        srv = start_server(str(tiny_llama_dir), served_model_name=[CHAT], max_model_len=256,
                           transcription_model=whisper, transcription_served_model_name=[WHISPER],
                           kv_cache_space=0.5, max_num_seqs=16, engine_process=engine_processes(args)[0])
    yield srv
    srv.stop()


# --------------------------------------------------------------------------------------------- batching

def test_concurrent_transcriptions_share_steps(duo):
    """Eight clients at once: every answer is the same transcript, the Whisper engine ran requests of
    several of them in one step, and afterwards holds nothing."""
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: post_audio(duo, model=WHISPER), range(8)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert len({r.json()["text"] for r in responses}) == 1
    assert whisper_stats(duo).max_reqs_per_step > 1
    assert parse_metric(httpx.get(duo.url + "/metrics").text, "chorus:max_num_reqs_per_step",
                        model_name=WHISPER) > 1
    assert_whisper_idle(duo)


# --------------------------------------------------------------------------------------------- formats

def test_response_formats(duo):
    verbose = post_audio(duo, response_format="verbose_json")
    assert verbose.status_code == 200 and verbose.headers["content-type"] == "application/json"
    v = verbose.json()
    text, segments = v["text"], v["segments"]
    assert text and v["task"] == "transcribe" and v["language"] == "english" and v["duration"] == 3.0
    assert v["usage"] == {"type": "duration", "seconds": 3}
    assert segments and [s["id"] for s in segments] == list(range(len(segments)))
    assert "".join(s["text"] for s in segments).strip() == text
    for s in segments:
        assert 0.0 <= s["start"] <= s["end"] <= 3.0 and s["tokens"] and 0.0 <= s["no_speech_prob"] <= 1.0

    plain = post_audio(duo)   # json is the default
    assert plain.headers["content-type"] == "application/json"
    assert plain.json() == {"text": text, "usage": {"type": "duration", "seconds": 3}}
    as_text = post_audio(duo, response_format="text")
    assert as_text.headers["content-type"].startswith("text/plain") and as_text.text == text + "\n"

    srt = post_audio(duo, response_format="srt")
    assert srt.headers["content-type"].startswith("text/plain")
    lines = srt.text.split("\n")
    assert len(lines) == 4 * len(segments) + 1 and lines[-1] == ""
    for i, s in enumerate(segments):
        number, times, cue, blank = lines[4 * i:4 * i + 4]
        assert number == str(i + 1) and re.fullmatch(f"{SRT_TIME} --> {SRT_TIME}", times), times
        assert times == f"{srt_time(s['start'])} --> {srt_time(s['end'])}"
        assert cue == s["text"].strip() and blank == ""

    vtt = post_audio(duo, response_format="vtt")
    assert vtt.headers["content-type"].startswith("text/vtt")
    lines = vtt.text.split("\n")
    assert lines[:2] == ["WEBVTT", ""] and len(lines) == 2 + 3 * len(segments) + 1
    for i, s in enumerate(segments):
        times, cue, blank = lines[2 + 3 * i:5 + 3 * i]
        assert re.fullmatch(f"{VTT_TIME} --> {VTT_TIME}", times), times
        assert times == f"{srt_time(s['start'])} --> {srt_time(s['end'])}".replace(",", ".")
        assert cue == s["text"].strip() and blank == ""


def test_speech_in_every_container(duo):
    """The espeak-ng clip of tests/data/audio as wav, flac, mp3 and ogg uploads: each transcript is the
    spoken sentence (a word off at most), and its srt cues span the speech."""
    if not (AUDIO_DIR / "clips.json").is_file():
        pytest.skip("no speech clips in tests/data/audio")
    clip = speech_clips()["fox"]

    def transcribe(ext: str) -> httpx.Response:
        return post_audio(duo, (AUDIO_DIR / f"fox.{ext}").read_bytes(), model=WHISPER)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(transcribe, ("wav", "flac", "mp3", "ogg")))
    for r in responses:
        assert r.status_code == 200, r.text
        assert word_error_rate(clip.text, r.json()["text"]) <= 1 / 9, r.json()["text"]
    srt = post_audio(duo, (AUDIO_DIR / "fox.wav").read_bytes(), response_format="srt").text
    times = re.findall(f"({SRT_TIME}) --> ({SRT_TIME})", srt)
    assert times and times[0][0].startswith("00:00:0") and times[-1][1] <= "00:00:04,000"


def srt_time(seconds: float) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


def test_streaming_events_in_audio_order(duo):
    """Two windows: deltas, then one done event whose text they add up to (and which equals the
    non-streamed transcript), then [DONE]."""
    whole = post_audio(duo, LONG).json()
    assert whole["usage"]["seconds"] == 40 and len(whole["text"].split()) >= 2   # a word per window
    r = post_audio(duo, LONG, stream="true", model=WHISPER)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *deltas, done = events[:-1]
    assert deltas and all(e["type"] == "transcript.text.delta" and e["delta"] for e in deltas)
    assert done == {"type": "transcript.text.done", "text": whole["text"],
                    "usage": {"type": "duration", "seconds": 40}}
    assert "".join(e["delta"] for e in deltas) == done["text"]
    as_text = post_audio(duo, LONG, stream="true", response_format="text")
    assert sse_events(as_text.text)[-2]["text"] == whole["text"]
    assert_whisper_idle(duo)


def test_openai_sdk(duo):
    """OpenAI's Python SDK reads every shape: verbose_json segments, text, the stream's typed events
    (it stops at [DONE]), and errors."""
    client = openai.OpenAI(base_url=duo.base_url, api_key="unused", max_retries=0)
    upload = ("audio.wav", SHORT, "audio/wav")
    verbose = client.audio.transcriptions.create(model=WHISPER, file=upload, response_format="verbose_json",
                                                 timestamp_granularities=["segment"])
    assert verbose.text and verbose.segments and verbose.segments[0].end <= 3.0
    plain = client.audio.transcriptions.create(model=WHISPER, file=upload)
    assert plain.text and plain.usage.seconds == 3
    assert client.audio.transcriptions.create(model=WHISPER, file=upload, response_format="text") \
        == plain.text + "\n"
    events = list(client.audio.transcriptions.create(model=WHISPER, file=upload, stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]) == events[-1].text
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.translations.create(model=WHISPER, file=upload)
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-9", file=upload)


# --------------------------------------------------------------------------------------------- errors

def corrupt_wav_header() -> bytes:
    return b"RIFF" + (1000).to_bytes(4, "little") + b"WAVEfmt " + bytes(30)


BAD_UPLOADS = {
    "missing file": (lambda: None, {}, 400, "file", "required"),
    "not audio": (lambda: b"This is a text file, not a recording.\n" * 10, {}, 400, "file", "not audio"),
    "empty file": (lambda: b"", {}, 400, "file", "empty"),
    "silent only": (lambda: wav(np.zeros(SAMPLE_RATE_HZ * 2, np.float32)), {}, 400, "file", "silent"),
    "corrupt header": (corrupt_wav_header, {}, 400, "file", "corrupt"),
    "unsupported format": (lambda: b"#!AMR\n" + bytes(400), {}, 400, "file", "unsupported audio format amr"),
    "over the duration cap": (lambda: wav(np.zeros(1000 * 3601, np.int16), 1000, "PCM_16"), {}, 400, "file",
                              "above the limit of 3600 s"),
    "over 25 MB": (lambda: bytes((25 << 20) + 1), {}, 413, "file", "above the limit of 26214400 bytes"),
    "bad response_format": (lambda: SHORT, {"response_format": "xml"}, 400, "response_format", "xml"),
    "bad language": (lambda: SHORT, {"language": "klingon"}, 400, "language", "Unknown language"),
    "language of another model": (lambda: SHORT, {"language": "de"}, 400, "language", "English-only"),
    "word granularity": (lambda: SHORT, {"timestamp_granularities[]": ["segment", "word"]}, 400,
                         "timestamp_granularities[]", "word"),
    "temperature out of range": (lambda: SHORT, {"temperature": "2.5"}, 400, "temperature", "outside"),
    "temperature not a number": (lambda: SHORT, {"temperature": "warm"}, 400, "temperature", "number"),
    "special token in prompt": (lambda: SHORT, {"prompt": "<|endoftext|>"}, 400, "prompt", "special token"),
    "stream of srt": (lambda: SHORT, {"stream": "true", "response_format": "srt"}, 400, "stream",
                      "json or text"),
    "unknown model": (lambda: SHORT, {"model": "whisper-9"}, 404, "model", "does not exist"),
    "the chat model": (lambda: SHORT, {"model": CHAT}, 400, "model", "chat model"),
}
"""Case -> (the upload's bytes, made when the test runs; form fields; status; param; words of the message)."""


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_requests_get_openai_errors(duo, case):
    make_data, fields, status, param, words = BAD_UPLOADS[case]
    err = assert_error(post_audio(duo, make_data(), **fields), status, param)
    assert words in err["message"], err["message"]


def test_a_full_size_upload_passes_the_body_limit(duo):
    """25 MiB of file reaches the route (the audio check, not the body limit, answers); a body above
    --max-request-body-bytes gets a 413 that says what audio may be."""
    err = assert_error(post_audio(duo, bytes(25 << 20)), 400, "file")
    assert "not audio" in err["message"]
    err = assert_error(post_audio(duo, bytes(33 << 20)), 413, "file")
    assert "Audio files may be at most 25 MB" in err["message"]


def test_translation_on_english_only_model_is_400(duo):
    err = assert_error(post_audio(duo, route="translations"), 400, "model")
    assert "English-only" in err["message"]


def test_errors_leave_nothing_in_the_engine(duo):
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda case: post_audio(duo, BAD_UPLOADS[case][0](), **BAD_UPLOADS[case][1]),
                      [c for c in BAD_UPLOADS if c != "over 25 MB"]))
    assert_whisper_idle(duo)
    assert post_audio(duo).status_code == 200   # still serving


# --------------------------------------------------------------------------------------------- disconnects

def test_disconnects_abort_every_window(duo):
    """A stream closed after its first delta, and a client that stops waiting for a plain response:
    the windows stop long before tiny.en would have finished them."""
    with httpx.stream("POST", f"{duo.base_url}/audio/transcriptions", data={"stream": "true"},
                      files={"file": ("a.wav", ENDLESS, "audio/wav")}, timeout=60) as r:
        first = next(r.iter_lines())
        assert json.loads(first[len("data: "):])["type"] == "transcript.text.delta"
    assert_whisper_idle(duo, timeout_s=5)
    with pytest.raises(httpx.ReadTimeout):
        post_audio(duo, ENDLESS, timeout=2.0)
    assert_whisper_idle(duo, timeout_s=5)


# --------------------------------------------------------------------------------------------- two models

def test_one_server_two_models(duo):
    models = httpx.get(duo.base_url + "/models").json()["data"]
    assert [m["id"] for m in models] == [CHAT, WHISPER]
    assert models[1]["max_model_len"] == 448
    assert httpx.get(duo.url + "/health").status_code == 200
    metrics = httpx.get(duo.url + "/metrics").text
    assert parse_metric(metrics, "chorus:engine_healthy", model_name=CHAT) == 1
    assert parse_metric(metrics, "chorus:engine_healthy", model_name=WHISPER) == 1
    assert metrics.count("# TYPE chorus:engine_healthy gauge") == 1

    chat = httpx.post(duo.base_url + "/chat/completions", timeout=60, json={
        "model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == CHAT
    completion = httpx.post(duo.base_url + "/completions", timeout=60,
                            json={"prompt": "hello", "max_tokens": 4})   # no model: the chat model
    assert completion.status_code == 200
    for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hello"})):
        err = assert_error(httpx.post(duo.base_url + path, json={"model": WHISPER, **body}), 400, "model")
        assert "only transcribes" in err["message"]
        assert_error(httpx.post(duo.base_url + path, json={"model": "nobody", **body}), 404, "model")

    # Both engines at once: a chat stream while a transcription runs.
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("audio", post_audio(duo, LONG)))
    thread.start()
    chat = httpx.post(duo.base_url + "/chat/completions", timeout=60, json={
        "model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True})
    thread.join(60)
    assert chat.status_code == 200 and sse_events(chat.text)[-1] == "[DONE]"
    assert results["audio"].status_code == 200
    assert_whisper_idle(duo)


def test_whisper_alone_server_and_chat_only_server(llama_server):
    """``chorus serve WHISPER_DIR``: audio routes work, chat routes are a 400 naming the model; a chat
    server's audio routes are a 400 saying to serve a Whisper model."""
    err = assert_error(post_audio(llama_server), 400, "model")
    assert "--transcription-model" in err["message"]
    srv = start_server(str(whisper_dir("tiny.en")), served_model_name=["tiny.en"], kv_cache_space=0.25,
                       max_num_seqs=4)
    try:
        assert post_audio(srv, response_format="text").text.strip()
        assert [m["id"] for m in httpx.get(srv.base_url + "/models").json()["data"]] == ["tiny.en"]
        err = assert_error(httpx.post(srv.base_url + "/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}]}), 400, "model")
        assert "tiny.en" in err["message"] and "only transcribes" in err["message"]
        assert_error(httpx.post(srv.base_url + "/completions", json={"model": "x", "prompt": "a"}), 404)
    finally:
        srv.stop()
