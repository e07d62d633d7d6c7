"""``chorus serve`` flags for Whisper: ``--task transcription`` (a Whisper model alone, tiny.en by default),
``--transcription-model`` (a second, Whisper engine next to the chat model), the checks that refuse
combinations that cannot work, before or after the models load, and ``chorus serve CHAT
--transcription-model default`` run as a user runs it."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import httpx
import pytest

from engine.cli import build_parser
from engine.server.app import check_engines
from engine.server.args import (check_task_args, engine_kwargs, engine_processes, make_serve_namespace,
                                transcription_engine_kwargs)
from tests.audio.whisper_reference import whisper_dir
from tests.server.conftest import free_port
from tests.server.test_audio_api import SHORT
from tests.server.test_cli import _spawn, _wait_healthy


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_task_transcription_serves_default_whisper():
    tiny_en = str(whisper_dir("tiny.en"))
    args = serve_args("--task", "transcription", "--max-logprobs", "5")
    check_task_args(args)
    kwargs = engine_kwargs(args)
    assert kwargs["model"] == tiny_en and kwargs["served_model_name"] == "whisper-tiny.en"
    assert kwargs["max_logprobs"] == 20   # every window reads the top 20 at its first step
    assert transcription_engine_kwargs(args) is None and engine_processes(args) == (False, False)
    assert engine_processes(serve_args(tiny_en, "--engine-process")) == (True, True)
    named = engine_kwargs(serve_args("--task", "transcription", "--served-model-name", "whisper-1"))
    assert named["served_model_name"] == "whisper-1"
    assert engine_kwargs(serve_args("/some/whisper", "--task", "transcription"))["model"] == "/some/whisper"


def test_engine_process_for_a_chat_model(tiny_llama_dir):
    assert engine_processes(serve_args(str(tiny_llama_dir), "--engine-process")) == (True, True)
    assert engine_processes(serve_args(str(tiny_llama_dir), "--no-engine-process")) == (False, False)


def test_transcription_model_is_a_second_engine():
    tiny_en = str(whisper_dir("tiny.en"))
    args = serve_args("chat-model", "--transcription-model", "default", "--max-model-len", "1k",
                      "--max-num-seqs", "8", "--enable-lora", "--chat-template", "{{ x }}")
    check_task_args(args)
    chat, whisper = engine_kwargs(args), transcription_engine_kwargs(args)
    assert chat["model"] == "chat-model" and chat["max_model_len"] == 1000 and chat["enable_lora"]
    assert whisper["model"] == tiny_en and whisper["served_model_name"] == "whisper-tiny.en"
    assert whisper["max_num_seqs"] == 8 and whisper["kv_cache_space"] == 1.0   # of --kv-cache-space 4
    for flag in ("max_model_len", "enable_lora", "chat_template", "tokenizer", "num_gpu_blocks_override"):
        assert flag not in whisper, flag   # MODEL's own flags stay MODEL's
    assert engine_processes(args) == (False, False)   # CPU: both engine loops in threads of this process
    named = transcription_engine_kwargs(serve_args(
        "m", "--transcription-model", "/w", "--kv-cache-space", "0.5",
        "--transcription-served-model-name", "whisper-1", "w"))
    assert named["model"] == "/w" and named["served_model_name"] == "whisper-1"
    assert named["kv_cache_space"] == 0.5


@pytest.mark.parametrize("argv, words", [
    (["--task", "transcription", "--transcription-model", "default"], "MODEL itself is the Whisper model"),
    (["m", "--transcription-served-model-name", "whisper-1"], "names the --transcription-model"),
    (["WHISPER", "--transcription-model", "default"], "already a Whisper model"),
])
def test_flag_combinations_that_cannot_work(argv, words):
    argv = [str(whisper_dir("tiny.en")) if a == "WHISPER" else a for a in argv]
    with pytest.raises(ValueError, match=words):
        check_task_args(serve_args(*argv))


def test_task_choices_and_help():
    with pytest.raises(SystemExit):
        serve_args("--task", "embedding")
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for flag in ("--task", "--transcription-model", "--transcription-served-model-name"):
        assert flag in text


def fake_engine(name: str, whisper: bool):
    transcriber = object() if whisper else None
    return SimpleNamespace(model_name=name, processor=SimpleNamespace(transcriber=transcriber))


@pytest.mark.parametrize("task, model_whisper, second, words", [
    ("transcription", False, None, "not a Whisper model"),
    ("generate", True, None, "is a Whisper model"),
    ("auto", True, True, "already a Whisper model"),
    ("auto", False, False, "--transcription-model chat-2 is not a Whisper model"),
])
def test_engines_that_do_not_fit_the_flags(task, model_whisper, second, words):
    second_engine = None if second is None else fake_engine("chat-2", second)
    with pytest.raises(ValueError, match=words):
        check_engines(make_serve_namespace(task=task), fake_engine("m", model_whisper), second_engine)
    check_engines(make_serve_namespace(), fake_engine("m", False), fake_engine("w", True))   # fits


def test_chorus_serve_chat_and_whisper(tiny_llama_dir):
    """One process, two engines: both routes answer, /v1/models lists both, SIGTERM stops them."""
    whisper_dir("tiny.en")   # skips without the wheel (nothing is downloaded)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn([str(tiny_llama_dir), "--served-model-name", "chat", "--max-model-len", "256",
                   "--transcription-model", "default", "--kv-cache-space", "0.5", "--max-num-seqs", "8"],
                  port)
    try:
        _wait_healthy(proc, url, 120)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["chat", "whisper-tiny.en"]
        audio = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("a.wav", SHORT)},
                           data={"model": "whisper-tiny.en", "response_format": "text"}, timeout=60)
        assert audio.status_code == 200 and audio.text.strip(), audio.text
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
