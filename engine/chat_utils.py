"""OpenAI chat messages with content parts -> (messages for the chat template, images and audios in order).

The first step of ``engine.chat_render.ChatRenderer``, which the server (``/v1/chat/completions``,
``/tokenize``) and the offline ``LLM.chat`` share.

A message's ``content`` is a string, None (rendered as ``""``) or a list of parts:

- ``{"type": "text", "text": str}``;
- ``{"type": "image_url", "image_url": {"url": str}}`` or ``{"type": "image_url", "image_url": str}``
  (vLLM's short form); the URL is http(s), ``data:image/...;base64,``, ``file://`` (server: only
  under ``--allowed-local-media-path``) or, offline, a file path;
- offline only: ``{"type": "image_pil", "image_pil": PIL.Image}`` and
  ``{"type": "image", "image": PIL image | path | URL | bytes}``;
- audio (audio-language models): OpenAI's ``{"type": "input_audio", "input_audio": {"data": base64,
  "format": "wav" | "mp3" | ...}}`` (carried on as a ``data:audio/<format>;base64,`` URL) and vLLM's
  ``{"type": "audio_url", "audio_url": {"url": str}}`` (or the short form with the URL as the value),
  whose URL is http(s), ``data:audio/...;base64,`` or ``file://`` (server: only under
  ``--allowed-local-media-path``), as an image URL; offline also ``{"type": "audio", "audio":
  (array, sample_rate) | path | bytes | URL}``.

Every image part becomes ``{"type": "image"}`` in the template's message, which the model's chat
template renders as its image placeholder (``<image>`` for LLaVA, ``<|vision_start|><|image_pad|>
<|vision_end|>`` for Qwen2-VL), as transformers' ``apply_chat_template`` does; the image sources go to
``multi_modal_data`` in the same order. Every audio part likewise becomes ``{"type": "audio"}`` (Qwen2-Audio's
template renders ``<|audio_bos|><|AUDIO|><|audio_eos|>``) and its source goes to ``multi_modal_data["audio"]``. A message with text parts only becomes one string (its parts
joined with ``'\\n'``, vLLM's "string" content format), so text-only templates keep working.

Nothing is fetched or decoded here (the processor does that, off the event loop in the server);
every malformed part is a ``ChatMessageError`` (a ValueError; HTTP 400) naming it, and image parts
sent to a text-only model, or audio parts to a model that takes no audio, are refused before anything is
fetched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from PIL import Image

TEXT_ONLY_MODEL = ("this model does not take images (it is text-only); send text content only, or serve a "
                   "vision model (LLaVA, Qwen2-VL, Qwen2.5-VL) to send images")
NO_AUDIO_MODEL = ("this model does not take audio; serve an audio-language model (Qwen2-Audio) to send audio, "
                  "or use /v1/audio/transcriptions with a Whisper model")
SERVER_PART_TYPES = ("text", "image_url", "input_audio", "audio_url")
"""Content part types the HTTP server takes."""
OFFLINE_PART_TYPES = SERVER_PART_TYPES + ("image_pil", "image", "audio")
"""Content part types ``LLM.chat`` takes (Python objects: PIL images, paths, (array, rate) pairs)."""
AUDIO_PART_TYPES = ("input_audio", "audio_url", "audio")
"""Content part types that carry audio."""
TEMPLATE_IMAGE_PART = {"type": "image"}
"""What an image part becomes in the template's message (the template renders the placeholder)."""
TEMPLATE_AUDIO_PART = {"type": "audio"}
"""What an audio part becomes in the template's message."""
AUDIO_FORMAT = re.compile(r"[A-Za-z0-9.+-]{1,16}")
"""An ``input_audio`` format name (``wav``, ``mp3``, ...): it becomes the data URL's media subtype."""


class ChatMessageError(ValueError):
    """A malformed message or content part, or an image part for a text-only model (the message names it)."""


@dataclass
class ParsedChat:
    """A conversation ready for the chat template and the engine."""

    messages: list[dict[str, Any]]
    """The messages for the chat template: content a string, or a list of text parts and
    ``{"type": "image"}`` parts where the conversation has images."""
    images: list[Any] = field(default_factory=list)
    """The image sources (URLs, PIL images, paths, bytes), in the order their placeholders appear;
    ``multi_modal_data={"image": images}``."""
    audios: list[Any] = field(default_factory=list)
    """The audio sources (URLs, data URLs; offline also (array, rate) pairs, paths, bytes), in placeholder
    order; ``multi_modal_data={"audio": audios}``."""


def parse_chat_messages(messages: Sequence[Mapping[str, Any]], *, takes_images: bool,
                        offline: bool = False, takes_audio: bool = False) -> ParsedChat:
    """Split OpenAI chat messages into template messages and image sources (see the module doc).

    Args:
        messages: dicts with ``role`` and ``content`` (other keys are kept for the template).
        takes_images: the model is a vision model; False: any image part is a ChatMessageError.
        offline: accept the offline part types (``image_pil``, ``image``, ``audio``) and non-URL sources.
        takes_audio: the model takes audio; False: any audio part is a ChatMessageError.

    Raises:
        ChatMessageError: a malformed message or part (named as ``messages[i].content[j]``), an unknown
            part type, or an image part for a text-only model.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatMessageError(f"messages: expected a list of message dicts, got {type(messages).__name__}.")
    out: list[dict[str, Any]] = []
    parsed = ParsedChat(out)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatMessageError(f"messages[{i}]: expected a dict with 'role' and 'content', got "
                                   f"{type(message).__name__}.")
        d = dict(message)
        content = d.get("content")
        if content is None:
            d["content"] = ""
        elif isinstance(content, list):
            d["content"] = _parse_parts(content, f"messages[{i}].content", parsed, takes_images, offline,
                                        takes_audio)
        elif not isinstance(content, str):
            raise ChatMessageError(f"messages[{i}].content: expected a string or a list of content parts, "
                                   f"got {type(content).__name__}.")
        out.append(d)
    return parsed


def _parse_parts(parts: list, where: str, parsed: ParsedChat, takes_images: bool,
                 offline: bool, takes_audio: bool) -> str | list[dict[str, Any]]:
    """One message's parts -> a string (text only) or template parts; appends its images and audios."""
    template_parts: list[dict[str, Any]] = []
    has_media = False
    for j, part in enumerate(parts):
        name = f"{where}[{j}]"
        if isinstance(part, Mapping) and part.get("type") in AUDIO_PART_TYPES:
            if not takes_audio:
                raise ChatMessageError(f"{name}: {NO_AUDIO_MODEL}.")
            source = _audio_source(part, name, offline)
            has_media = True
            parsed.audios.append(source)
            template_parts.append(dict(TEMPLATE_AUDIO_PART))
            continue
        source = _image_source(part, name, offline)
        if source is None:
            template_parts.append({"type": "text", "text": part["text"]})
            continue
        if not takes_images:
            raise ChatMessageError(f"{name}: {TEXT_ONLY_MODEL}.")
        has_media = True
        parsed.images.append(source)
        template_parts.append(dict(TEMPLATE_IMAGE_PART))
    if not has_media:
        return "\n".join(p["text"] for p in template_parts)
    return template_parts


def _image_source(part: Any, name: str, offline: bool) -> Any:
    """The image source of an image part; None for a (checked) text part. ChatMessageError otherwise."""
    allowed = OFFLINE_PART_TYPES if offline else SERVER_PART_TYPES
    if not isinstance(part, Mapping):
        raise ChatMessageError(f"{name}: a content part must be a dict like {{'type': 'text', 'text': ...}}, "
                               f"got {type(part).__name__}.")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise ChatMessageError(f"{name}: a content part needs a 'type' ({', '.join(allowed)}).")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ChatMessageError(f"{name}: a text part needs 'text', a string.")
        return None
    if kind not in allowed:
        if kind in OFFLINE_PART_TYPES:
            raise ChatMessageError(f"{name}: content part type {kind!r} is only accepted by the offline "
                                   "LLM.chat; send {'type': 'image_url', 'image_url': {'url': ...}} with an "
                                   "http(s) or data:image/...;base64, URL.")
        raise ChatMessageError(f"{name}: unsupported content part type {kind!r}; use one of "
                               f"{', '.join(allowed)}.")
    if kind == "image_url":
        return _part_url(part, name, "image")
    value = part.get(kind)   # image_pil / image (offline)
    if kind == "image_pil" and not isinstance(value, Image.Image):
        raise ChatMessageError(f"{name}: an image_pil part needs 'image_pil', a PIL image, got "
                               f"{type(value).__name__}.")
    empty = isinstance(value, (str, bytes, bytearray)) and not value
    if empty or not isinstance(value, (Image.Image, str, bytes, bytearray, os.PathLike)):
        raise ChatMessageError(f"{name}: an image part needs 'image': a PIL image, a file path, a URL or "
                               f"bytes, got {type(value).__name__}.")
    return value


def _part_url(part: Mapping[str, Any], name: str, media: str) -> str:
    """The URL of an ``image_url`` / ``audio_url`` part (``media``: "image" / "audio"): ``{"url": str}`` or
    vLLM's short form, the URL itself. ChatMessageError unless it is a non-empty string."""
    kind = f"{media}_url"
    value = part.get(kind)
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url.strip():
        raise ChatMessageError(f"{name}: an {kind} part needs '{kind}': {{'url': <http(s) or "
                               f"data:{media}/...;base64, URL>}}, a non-empty string.")
    return url


def _audio_source(part: Mapping[str, Any], name: str, offline: bool) -> Any:
    """The audio source of an ``input_audio`` / ``audio_url`` / (offline) ``audio`` part: a URL (an
    ``input_audio`` becomes a ``data:audio/<format>;base64,`` URL, decoded later), or offline an (array,
    rate) pair, a path or bytes. ChatMessageError for a malformed part."""
    kind = part["type"]
    if kind == "input_audio":
        value = part.get("input_audio")
        data = value.get("data") if isinstance(value, Mapping) else None
        fmt = value.get("format", "wav") if isinstance(value, Mapping) else None
        if not isinstance(data, str) or not data.strip() or not isinstance(fmt, str) \
                or not AUDIO_FORMAT.fullmatch(fmt):
            raise ChatMessageError(f"{name}: an input_audio part needs 'input_audio': {{'data': <base64 audio>, "
                                   "'format': 'wav' | 'mp3' | ...}, a non-empty base64 string and a format name.")
        return f"data:audio/{fmt.lower()};base64,{data}"
    if kind == "audio_url":
        return _part_url(part, name, "audio")
    if not offline:
        raise ChatMessageError(f"{name}: content part type 'audio' is only accepted by the offline LLM.chat; "
                               "send {'type': 'input_audio', 'input_audio': {'data': <base64>, 'format': 'wav'}}.")
    value = part.get("audio")
    empty = isinstance(value, (str, bytes, bytearray)) and not value
    if empty or not isinstance(value, (tuple, str, bytes, bytearray, os.PathLike)):
        raise ChatMessageError(f"{name}: an audio part needs 'audio': an (array, sample_rate) pair, a file path, "
                               f"a URL or bytes, got {type(value).__name__}.")
    return value
