"""OpenAI's audio response formats (``response_format``) and streaming events, from a finished transcript.

``render(response_format, ...)`` gives the body and media type of ``/v1/audio/transcriptions`` and
``/v1/audio/translations``:

- ``json``: ``{"text": ..., "usage": {"type": "duration", "seconds": N}}``;
- ``text``: the text and a newline, ``text/plain``;
- ``verbose_json``: task, language (English name, lowercase: "english"), duration, text, segments
  (id, seek, start, end, text, tokens, temperature, avg_logprob, compression_ratio, no_speech_prob), usage;
- ``srt``: numbered cues ``1\\n00:00:00,000 --> 00:00:02,500\\nText\\n\\n``, ``text/plain``;
- ``vtt``: ``WEBVTT\\n\\n`` then cues ``00:00:00.000 --> 00:00:02.500\\nText\\n\\n``, ``text/vtt``.

Cue text is the segment's text stripped, with ``-->`` written ``->`` (OpenAI whisper's ``WriteSRT`` /
``WriteVTT``); cue times are rounded to the millisecond and always carry hours (OpenAI's API does,
whisper's CLI drops them in VTT under an hour). The transcript's ``text`` is stripped of the leading
space Whisper's tokens carry; a segment's ``text`` in verbose_json keeps it, as OpenAI's.

Streaming (``stream=true``): ``transcript_text_delta`` and ``transcript_text_done`` build OpenAI's
``transcript.text.delta`` / ``transcript.text.done`` events (send them with ``protocol.sse_event``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from multimodal.whisper_decoding import Segment, language_name

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
RESPONSE_FORMATS: tuple[str, ...] = ("json", "text", "srt", "verbose_json", "vtt")
"""The ``response_format`` values OpenAI's audio endpoints accept (and this server renders)."""
MEDIA_TYPES: dict[str, str] = {"json": "application/json", "verbose_json": "application/json",
                               "text": "text/plain", "srt": "text/plain", "vtt": "text/vtt"}
"""Media type of each format's body (Starlette appends ``; charset=utf-8`` to the text ones)."""


def render(response_format: str, *, text: str, segments: list[Segment], language: str | None,
           duration_s: float, task: str = "transcribe", include_usage: bool = True) -> tuple[str | dict, str]:
    """The body (a JSON-able dict for json / verbose_json, else a string) and its media type.

    Args:
        response_format: one of ``RESPONSE_FORMATS``.
        text: the whole transcript.
        segments: its timed segments (``parse_segments``), renumbered over the whole audio.
        language: the language code ("en"), of the audio; translations report "english".
        duration_s: the audio's duration in seconds.
        task: "transcribe" or "translate".
        include_usage: add OpenAI's ``usage`` (``{"type": "duration", "seconds": ceil(duration)}``).

    Raises:
        ValueError: an unknown ``response_format`` (an HTTP 400).
    """
    if response_format not in RESPONSE_FORMATS:
        raise ValueError(f"Unknown response_format {response_format!r}; use one of: "
                         f"{', '.join(RESPONSE_FORMATS)}.")
    media_type = MEDIA_TYPES[response_format]
    usage = {"usage": duration_usage(duration_s)} if include_usage else {}
    if response_format == "json":
        return {"text": text.strip(), **usage}, media_type
    if response_format == "text":
        return text.strip() + "\n", media_type
    if response_format == "srt":
        return to_srt(segments), media_type
    if response_format == "vtt":
        return to_vtt(segments), media_type
    language_out = "english" if task == "translate" else language_name(language) if language else ""
    return {"task": task, "language": language_out, "duration": duration_s, "text": text.strip(),
            "segments": [segment_json(s) for s in segments], **usage}, media_type


def duration_usage(duration_s: float) -> dict[str, Any]:
    """OpenAI's duration-billed usage: whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(duration_s)}


def segment_json(segment: Segment) -> dict[str, Any]:
    """One verbose_json segment. Unknown avg_logprob / no_speech_prob are written 0.0 (OpenAI's clients
    require numbers)."""
    return {"id": segment.id, "seek": segment.seek, "start": segment.start_s, "end": segment.end_s,
            "text": segment.text, "tokens": list(segment.token_ids), "temperature": segment.temperature,
            "avg_logprob": segment.avg_logprob if segment.avg_logprob is not None else 0.0,
            "compression_ratio": segment.compression_ratio,
            "no_speech_prob": segment.no_speech_prob if segment.no_speech_prob is not None else 0.0}


def format_timestamp(seconds: float, decimal_marker: str) -> str:
    """``HH:MM:SS<marker>mmm`` (OpenAI whisper's ``format_timestamp`` with hours always shown)."""
    if seconds < 0:
        raise ValueError(f"negative timestamp {seconds}")
    milliseconds = round(seconds * 1000.0)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    whole_seconds, milliseconds = divmod(milliseconds, 1_000)
    return f"{hours:02d}:{minutes:02d}:{whole_seconds:02d}{decimal_marker}{milliseconds:03d}"


def _cue_text(segment: Segment) -> str:
    return segment.text.strip().replace("-->", "->")


def to_srt(segments: list[Segment]) -> str:
    """SubRip: cues numbered from 1, ``HH:MM:SS,mmm``, each followed by a blank line."""
    return "".join(f"{i}\n{format_timestamp(s.start_s, ',')} --> {format_timestamp(s.end_s, ',')}\n"
                   f"{_cue_text(s)}\n\n" for i, s in enumerate(segments, start=1))


def to_vtt(segments: list[Segment]) -> str:
    """WebVTT: the ``WEBVTT`` header, then un-numbered cues ``HH:MM:SS.mmm``, each and a blank line."""
    return "WEBVTT\n\n" + "".join(f"{format_timestamp(s.start_s, '.')} --> {format_timestamp(s.end_s, '.')}\n"
                                  f"{_cue_text(s)}\n\n" for s in segments)


# ----------------------------------------------------------------------------------------- streaming

def logprob_entry(token: str, logprob: float, token_bytes: bytes | None = None) -> dict[str, Any]:
    """One entry of an event's ``logprobs`` (``include[]=logprobs``): token, logprob, UTF-8 bytes."""
    data = token.encode("utf-8") if token_bytes is None else token_bytes
    return {"token": token, "logprob": logprob, "bytes": list(data)}


def transcript_text_delta(delta: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"type": "transcript.text.delta", "delta": ...}``, with ``logprobs`` only when given."""
    event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta}
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event


def transcript_text_done(text: str, logprobs: list[dict[str, Any]] | None = None,
                         usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"type": "transcript.text.done", "text": ...}`` (the whole text, stripped), with ``logprobs`` and
    ``usage`` only when given."""
    event: dict[str, Any] = {"type": "transcript.text.done", "text": text.strip()}
    if logprobs is not None:
        event["logprobs"] = logprobs
    if usage is not None:
        event["usage"] = usage
    return event
