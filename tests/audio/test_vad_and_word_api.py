"""``--audio-chunking vad`` (silero-vad through onnxruntime) and word timestamps over HTTP, with the real
Whisper tiny.en on CPU.

- Real speech, 25 s of digital silence, real speech: the voice-activity chunker gives one window per
  utterance, neither covering the silence (the quiet chunker's windows cover every sample), and the
  transcript has both utterances' words, with no segment or word timed inside the silence.
- Without silero-vad or onnxruntime, ``vad`` stops the engine at start-up with a one-line error carrying
  the install command.
- ``timestamp_granularities[]=word``: a 400 without ``verbose_json`` (as OpenAI's); with it, ``words`` with
  increasing times that reassemble to the text, also through an engine process; refused with LoRA enabled.
"""

from __future__ import annotations

import importlib.util
import io

import httpx
import numpy as np
import pytest
import soundfile

from engine.config import MultiModalConfig
from engine.llm import LLM
from engine.transcription import audio_chunker
from multimodal.audio_chunking import QuietChunker
from multimodal.vad import VadUnavailableError
from tests.audio.whisper_reference import AUDIO_DIR, load_wav, normalized_words, whisper_dir
from tests.server.conftest import start_server
from tests.server.test_errors import assert_error

RATE = 16000
SILENCE_S = 25.0


def _speech_silence_speech() -> tuple[np.ndarray, float, float]:
    """fox, 25 s of zeros, hello: (samples, end of fox s, start of hello s)."""
    fox, hello = load_wav("fox")[0], load_wav("hello")[0]
    samples = np.concatenate([fox, np.zeros(int(SILENCE_S * RATE), np.float32), hello])
    return samples, fox.shape[0] / RATE, fox.shape[0] / RATE + SILENCE_S


def test_vad_unavailable_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "silero_vad" else real(name, *a))
    with pytest.raises(VadUnavailableError, match=r"needs silero_vad, which is not installed; run: pip install "
                                                  r"'chorus\[vad\]'") as caught:
        audio_chunker("vad")
    assert "\n" not in str(caught.value)
    with pytest.raises(VadUnavailableError, match="pip install"):      # the engine stops at start-up
        LLM(model=str(whisper_dir("tiny.en")), device="cpu", dtype="float32", audio_chunking="vad")
    from engine.server.app import startup_error
    line = str(startup_error(VadUnavailableError(str(caught.value))))
    assert "\n" not in line and "--audio-chunking" in line and "pip install 'chorus[vad]'" in line
    with pytest.raises(ValueError, match="use 'quiet' or 'vad'"):
        MultiModalConfig(audio_chunking="silence")
    with pytest.raises(ValueError, match="use one of quiet, vad"):
        audio_chunker("silence")


def test_vad_windows_split_between_utterances_and_skip_the_silence():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("silero_vad")
    samples, fox_end_s, hello_start_s = _speech_silence_speech()
    chunks = audio_chunker("vad").chunks(samples, RATE, 30.0)
    assert len(chunks) == 2
    first, second = chunks
    assert first.start_s <= 0.1 and fox_end_s - 0.5 < first.end_s < fox_end_s + 1.0
    assert hello_start_s - 1.0 < second.start_s < hello_start_s + 0.5 and second.end_s == samples.shape[0] / RATE
    assert first.end_s < fox_end_s + 1.0 < hello_start_s - 1.0 < second.start_s     # the silence is in no window
    quiet = QuietChunker().chunks(samples, RATE, 30.0)
    assert quiet[0].start_s == 0.0 and quiet[-1].end_s == samples.shape[0] / RATE   # quiet covers everything
    assert len(audio_chunker("vad").chunks(np.zeros(RATE * 3, np.float32), RATE, 30.0)) == 0


def test_vad_transcription_has_both_utterances_and_nothing_from_the_silence():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("silero_vad")
    samples, fox_end_s, hello_start_s = _speech_silence_speech()
    llm = LLM(model=str(whisper_dir("tiny.en")), device="cpu", dtype="float32", audio_chunking="vad")
    result = llm.transcribe((samples, RATE), timestamps=True, word_timestamps=True)
    assert len(result.window_texts) == 2
    words = set(normalized_words(result.text))
    assert {"quick", "brown", "fox", "lazy", "dog"} <= words and {"this", "test", "service"} <= words
    for segment in result.segments:
        assert not fox_end_s + 1.0 < segment.start_s < hello_start_s - 1.0, segment
    for word in result.words:
        assert word.end_s <= fox_end_s + 1.0 or word.start_s >= hello_start_s - 1.0, word
    assert "".join(w.word for w in result.words).strip() == result.text


@pytest.fixture(scope="module")
def whisper_server():
    srv = start_server(str(whisper_dir("tiny.en")), max_num_seqs=8, kv_cache_space=0.5)
    yield srv
    srv.stop()


def _post(server, samples: np.ndarray, **fields) -> httpx.Response:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, RATE, format="WAV", subtype="PCM_16")
    return httpx.post(f"{server.base_url}/audio/transcriptions",
                      files={"file": ("audio.wav", buffer.getvalue(), "audio/wav")}, data=fields, timeout=120)


def test_word_granularity_over_http(whisper_server):
    audio = load_wav("weather")[0]
    for response_format in ("json", "text", "srt"):
        r = _post(whisper_server, audio, response_format=response_format, **{"timestamp_granularities[]": "word"})
        err = assert_error(r, 400, "timestamp_granularities[]")
        assert "verbose_json" in err["message"]
    r = _post(whisper_server, audio, response_format="verbose_json", **{"timestamp_granularities[]": "word"})
    assert r.status_code == 200, r.text
    body = r.json()
    words, text = body["words"], body["text"]
    assert words and " ".join(w["word"] for w in words) == text and body["segments"]
    assert all(set(w) == {"word", "start", "end"} and 0.0 <= w["start"] <= w["end"] <= body["duration"]
               for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)
    plain = _post(whisper_server, audio, response_format="verbose_json")
    assert "words" not in plain.json() and plain.json()["text"] == text


def test_word_timestamps_are_refused_with_lora_enabled():
    llm = LLM(model=str(whisper_dir("tiny.en")), device="cpu", dtype="float32", enable_lora=True)
    with pytest.raises(ValueError, match="not available with enable_lora"):
        llm.transcribe(str(AUDIO_DIR / "fox.wav"), word_timestamps=True)


def test_word_timestamps_through_an_engine_process():
    """The alignment call and its answer cross the engine process's pipe (CUDA's default mode)."""
    server = start_server(str(whisper_dir("tiny.en")), max_num_seqs=4, kv_cache_space=0.5, engine_process=True)
    try:
        r = _post(server, load_wav("fox")[0], response_format="verbose_json", **{"timestamp_granularities[]": "word"})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    words = r.json()["words"]
    assert words and " ".join(w["word"] for w in words) == r.json()["text"] and words[-1]["end"] <= 3.7
