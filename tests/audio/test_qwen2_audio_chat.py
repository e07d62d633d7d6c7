"""Audio in chat with Qwen2-Audio (tiny random checkpoint, ``tests.audio.qwen2_audio_reference``): ``LLM.chat``
and ``/v1/chat/completions`` with ``input_audio`` and ``audio_url`` parts equal transformers' greedy run of
the rendered conversation; the file:// guard; bad audio, too many clips, audio to a model without audio:
400s with the reason and nothing held; ``--limit-mm-per-prompt audio=N``."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from engine.llm import LLM
from tests.audio.qwen2_audio_reference import (AUDIO, AUDIO_DIR, MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, audio_prompt,
                                               hf_greedy, hf_inputs, hf_model, params, wav_base64)
from tests.models.utils import check_logprobs_close, ours_as_ref



def test_llm_chat_with_audio_parts(audio_llm, qwen2_audio_dir, audio_clips):
    """LLM.chat with an input_audio part and an offline (array, rate) audio part: the processor's chat
    template, then transformers' greedy continuation with those audio_clips."""
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": wav_base64("fox.wav"), "format": "wav"}},
        {"type": "audio", "audio": (audio_clips[1], 16000)},
        {"type": "text", "text": "Which one is louder?"}]}]
    _, processor = hf_model(str(qwen2_audio_dir))
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "audio", "audio_url": "a"}, {"type": "audio", "audio_url": "b"},
        {"type": "text", "text": "Which one is louder?"}]}], add_generation_prompt=True, tokenize=False)
    assert text.count(AUDIO) == 2
    out = audio_llm.chat(messages, params(), use_tqdm=False)
    check_logprobs_close(hf_greedy(qwen2_audio_dir, text, audio_clips[:2]), ours_as_ref(out[0].outputs[0]), "chat")


# ------------------------------------------------------------------------------------------------ server
MODEL = "tiny-qwen2-audio"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """--allowed-local-media-path: fox.wav inside, and a symlink inside that points outside (to hello.wav)."""
    d = tmp_path_factory.mktemp("allowed-media")
    (d / "fox.wav").write_bytes((AUDIO_DIR / "fox.wav").read_bytes())
    (d / "escape.wav").symlink_to(AUDIO_DIR / "hello.wav")
    return d


@pytest.fixture(scope="module")
def server(qwen2_audio_dir, media_dir):
    from tests.server.conftest import start_server
    srv = start_server(str(qwen2_audio_dir), served_model_name=[MODEL], dtype="float32", device="cpu",
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=4, limit_mm_per_prompt={"audio": 2},
                       allowed_local_media_path=str(media_dir))
    yield srv
    srv.stop()


def chat(srv, parts: list[dict], model: str = MODEL):
    import httpx
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": parts}]}
    return httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)


def assert_nothing_held(srv) -> None:
    from tests.server.conftest import wait_until
    client = srv.engine_client
    assert wait_until(lambda: client.num_tracked_requests == 0 and client.num_sequences_in_flight == 0)
    assert client.processor.media_budget.num_bytes == 0


def test_chat_completions_input_audio_and_audio_url(server, qwen2_audio_dir, audio_clips):
    """input_audio (base64 wav) and audio_url (data URL) parts: the reply is transformers' greedy continuation
    of the rendered conversation with both audio_clips, and the prompt is as long as transformers' input ids."""
    url = "data:audio/wav;base64," + wav_base64("hello.wav")
    parts = [{"type": "input_audio", "input_audio": {"data": wav_base64("fox.wav"), "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "Same speaker?"}]
    _, processor = hf_model(str(qwen2_audio_dir))
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "audio", "audio_url": "a"}, {"type": "audio", "audio_url": "b"},
        {"type": "text", "text": "Same speaker?"}]}], add_generation_prompt=True, tokenize=False)
    ref = hf_greedy(qwen2_audio_dir, text, audio_clips[:2])
    r = chat(server, parts)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == processor.tokenizer.decode(ref.token_ids,
                                                                                      skip_special_tokens=True)
    num_prompt_tokens = hf_inputs(qwen2_audio_dir, text, audio_clips[:2])["input_ids"].shape[1]
    assert r.json()["usage"]["prompt_tokens"] == num_prompt_tokens
    assert_nothing_held(server)


def test_file_url_guard(server, media_dir):
    """file:// audio URLs: a file under --allowed-local-media-path is read; a path outside it, a symlink
    inside that leads outside, and '..' out of it are 400s that read nothing."""
    inside = chat(server, [{"type": "audio_url", "audio_url": {"url": (media_dir / "fox.wav").as_uri()}},
                           {"type": "text", "text": "hi"}])
    assert inside.status_code == 200, inside.text
    for url in ((AUDIO_DIR / "fox.wav").as_uri(), (media_dir / "escape.wav").as_uri(),
                f"file://{media_dir}/../{media_dir.name}/../../etc/passwd", "file:///etc/passwd"):
        r = chat(server, [{"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "hi"}])
        assert r.status_code == 400, (url, r.text)
        assert "outside the allowed media directory" in r.json()["error"]["message"], r.text
    assert_nothing_held(server)


def test_file_urls_refused_without_the_flag():
    """Where no directory is allowed, a file:// audio URL is refused before any path is touched."""
    from multimodal.media import MediaError, MediaLimits, read_audio_source
    with pytest.raises(MediaError, match="file:// URLs are not enabled"):
        read_audio_source((AUDIO_DIR / "fox.wav").as_uri(), MediaLimits(), 1 << 20)


@pytest.mark.parametrize("parts, reason", [
    ([{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"no audio here" * 50).decode(),
                                              "format": "wav"}}], "not audio"),
    ([{"type": "input_audio", "input_audio": {"data": "%%%not base64", "format": "wav"}}], "not valid base64"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "needs 'input_audio'"),
    ([{"type": "audio_url", "audio_url": {"url": " "}}], "an audio_url part needs 'audio_url'"),
    ([{"type": "audio", "audio": "/etc/passwd"}], "only accepted by the offline LLM.chat"),
    ([{"type": "audio_url", "audio_url": {"url": "data:image/png;base64,AAAA"}}], "must hold audio"),
    ([{"type": "audio_url", "audio_url": {"url": "ftp://example.com/a.wav"}}], "unsupported audio URL"),
    ([{"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:9/a.wav"}}], "must point to public addresses"),
    ([{"type": "audio_url", "audio_url": "http://[::ffff:10.0.0.1]/a.wav"}], "must point to public addresses"),
    ([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}] * 3, "at most 2 audio(s)"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "takes audio, not image"),
])
def test_bad_audio_is_a_400_with_the_reason(server, parts, reason):
    r = chat(server, parts + [{"type": "text", "text": "hi"}])
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"], r.text
    assert_nothing_held(server)


def test_audio_to_a_model_without_audio_is_a_400(tiny_llama_dir):
    from tests.server.conftest import start_server
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=128)
    try:
        r = chat(srv, [{"type": "input_audio", "input_audio": {"data": wav_base64("fox.wav"), "format": "wav"}}],
                 model="tiny-llama")
        assert r.status_code == 400, r.text
        assert "does not take audio" in r.json()["error"]["message"]
        assert_nothing_held(srv)
    finally:
        srv.stop()


def test_limit_mm_per_prompt_takes_audio(qwen2_audio_dir, audio_clips):
    """--limit-mm-per-prompt audio=N (either form) reaches the engine; a prompt over it is refused."""
    import argparse

    from engine.server.args import add_serve_args, engine_kwargs
    p = add_serve_args(argparse.ArgumentParser(prog="chorus serve"))
    for flag in ("audio=1", '{"audio": 1}', "image=0,audio=1"):
        assert engine_kwargs(p.parse_args(["--limit-mm-per-prompt", flag]))["limit_mm_per_prompt"]["audio"] == 1
    llm = LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
              limit_mm_per_prompt={"audio": 1})
    with pytest.raises(ValueError, match=r"at most 1 audio\(s\) per prompt"):
        llm.generate(audio_prompt(PROMPTS[1], audio_clips[:2]), params(), use_tqdm=False)
