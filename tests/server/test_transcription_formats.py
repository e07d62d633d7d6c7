"""engine/server/transcription_formats.py: OpenAI's json / text / verbose_json / srt / vtt bodies and the
transcript.text.* streaming events, checked line by line and against the OpenAI SDK's response types."""

from __future__ import annotations

import json

import pytest

from engine.server.transcription_formats import (RESPONSE_FORMATS, format_timestamp, logprob_entry, render,
                                                 transcript_text_delta, transcript_text_done)
from multimodal.whisper_decoding import Segment


def segment(id, start_s, end_s, text, token_ids=(50364, 400, 50489)):
    return Segment(id=id, seek=0, start_s=start_s, end_s=end_s, text=text, token_ids=list(token_ids),
                   temperature=0.0, avg_logprob=-0.25, compression_ratio=1.1, no_speech_prob=0.01)


SEGMENTS = [segment(0, 0.0, 2.5, " Hello world."),
            segment(1, 2.5, 61.0004, " a --> b "),
            segment(2, 3599.9994, 3723.45, " Late.")]
TEXT = " Hello world. a --> b  Late."


def body(response_format, **kwargs):
    kwargs = {"text": TEXT, "segments": SEGMENTS, "language": "en", "duration_s": 3724.2, **kwargs}
    return render(response_format, **kwargs)


def test_srt_line_by_line():
    srt, media_type = body("srt")
    assert media_type == "text/plain"
    assert srt.split("\n") == [
        "1", "00:00:00,000 --> 00:00:02,500", "Hello world.", "",
        "2", "00:00:02,500 --> 00:01:01,000", "a -> b", "",
        "3", "00:59:59,999 --> 01:02:03,450", "Late.", "",
        "",
    ]
    assert srt.endswith("Late.\n\n")


def test_vtt_line_by_line():
    vtt, media_type = body("vtt")
    assert media_type == "text/vtt"
    assert vtt.split("\n") == [
        "WEBVTT", "",
        "00:00:00.000 --> 00:00:02.500", "Hello world.", "",
        "00:00:02.500 --> 00:01:01.000", "a -> b", "",
        "00:59:59.999 --> 01:02:03.450", "Late.", "",
        "",
    ]
    assert body("vtt", segments=[])[0] == "WEBVTT\n\n" and body("srt", segments=[])[0] == ""


def test_format_timestamp():
    assert format_timestamp(0.0, ",") == "00:00:00,000"
    assert format_timestamp(2.4996, ".") == "00:00:02.500"           # rounded to the millisecond
    assert format_timestamp(59.9996, ",") == "00:01:00,000"          # the carry reaches the minutes
    assert format_timestamp(36000 + 61.5, ".") == "10:01:01.500"
    with pytest.raises(ValueError):
        format_timestamp(-0.5, ",")


def test_json_and_text():
    assert body("json") == ({"text": "Hello world. a --> b  Late.",
                             "usage": {"type": "duration", "seconds": 3725}}, "application/json")
    assert body("json", include_usage=False)[0] == {"text": "Hello world. a --> b  Late."}
    assert body("text") == ("Hello world. a --> b  Late.\n", "text/plain")


def test_verbose_json():
    verbose, media_type = body("verbose_json")
    assert media_type == "application/json"
    assert verbose["task"] == "transcribe" and verbose["language"] == "english"
    assert verbose["duration"] == 3724.2 and verbose["text"] == "Hello world. a --> b  Late."
    assert verbose["usage"] == {"type": "duration", "seconds": 3725}
    assert verbose["segments"][0] == {
        "id": 0, "seek": 0, "start": 0.0, "end": 2.5, "text": " Hello world.", "tokens": [50364, 400, 50489],
        "temperature": 0.0, "avg_logprob": -0.25, "compression_ratio": 1.1, "no_speech_prob": 0.01}
    json.dumps(verbose)                                           # JSON-able as is
    german = body("verbose_json", language="de")[0]
    assert german["language"] == "german"
    translated = body("verbose_json", language="de", task="translate")[0]
    assert translated["task"] == "translate" and translated["language"] == "english"
    unknown = segment(0, 0.0, 1.0, " x")
    unknown.avg_logprob = unknown.no_speech_prob = None
    row = body("verbose_json", segments=[unknown])[0]["segments"][0]
    assert row["avg_logprob"] == 0.0 and row["no_speech_prob"] == 0.0


def test_bodies_parse_as_openai_sdk_types():
    types = pytest.importorskip("openai.types.audio")
    verbose = types.TranscriptionVerbose.model_validate(body("verbose_json")[0])
    assert verbose.segments[1].text == " a --> b " and verbose.usage.seconds == 3725
    assert types.Transcription.model_validate(body("json")[0]).text == "Hello world. a --> b  Late."
    translation = types.TranslationVerbose.model_validate(body("verbose_json", task="translate")[0])
    assert translation.language == "english"
    delta = types.TranscriptionTextDeltaEvent.model_validate(
        transcript_text_delta(" wonder", [logprob_entry(" wonder", -0.5)]))
    assert delta.type == "transcript.text.delta" and delta.logprobs[0].bytes == list(b" wonder")
    done = types.TranscriptionTextDoneEvent.model_validate(transcript_text_done(" Hello world."))
    assert done.type == "transcript.text.done" and done.text == "Hello world."


def test_stream_events():
    assert transcript_text_delta(" Hel") == {"type": "transcript.text.delta", "delta": " Hel"}
    entry = logprob_entry("é", -1.25)
    assert entry == {"token": "é", "logprob": -1.25, "bytes": [0xC3, 0xA9]}
    assert logprob_entry("\ufffd", -2.0, b"\xc3")["bytes"] == [0xC3]    # a partial UTF-8 token's own bytes
    assert transcript_text_delta("lo", [entry]) == {"type": "transcript.text.delta", "delta": "lo",
                                                   "logprobs": [entry]}
    assert transcript_text_done(" Hello.") == {"type": "transcript.text.done", "text": "Hello."}
    usage = {"type": "tokens", "input_tokens": 10, "output_tokens": 3, "total_tokens": 13}
    assert transcript_text_done("Hi", [entry], usage) == {"type": "transcript.text.done", "text": "Hi",
                                                         "logprobs": [entry], "usage": usage}


def test_unknown_format():
    assert RESPONSE_FORMATS == ("json", "text", "srt", "verbose_json", "vtt")
    with pytest.raises(ValueError, match="Unknown response_format 'xml'; use one of: json, text, srt"):
        body("xml")
