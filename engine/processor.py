"""User input -> validated ``EngineRequest``s. Every user error is a ``ValueError`` raised here.

Handles prompt forms (text, token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``, either with
``"multi_modal_data": {"image": ...}``), media (loaded, checked, preprocessed and placed: ``multimodal/``),
length checks, the n > 1 fan-out (children share the prompt's KV blocks through the prefix cache) and
adapter checks. It holds the model's ``ChatRenderer`` (``engine/chat_render.py``): a chat reaches
``process`` rendered and tokenized, as ``prompt_token_ids``.

The encoder-cache key of every media item is final when ``process`` returns: the content hash, and the
adapter's name too when the request's adapter updates an encoder projection (``encoder_keyed``).

A constrained request (``SamplingParams.structured_outputs``) has its grammar compiled here, in the
caller's worker thread, by the engine's ``GrammarCompilePool`` (the engine then finds it in the pool's
cache): a schema, regex or grammar that does not compile is a ``StructuredOutputError`` (a 400 naming
``structured_outputs`` or ``response_format``, with the compiler's reason) before anything is queued.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from engine.chat_render import ChatRenderer
from engine.chat_template import TemplateLimits
from engine.config import ModelConfig, MultiModalConfig
from engine.request import EngineRequest, MultiModalFeature, PlaceholderRange
from engine.sampling_params import SamplingParams
from engine.structured_output.compiler import GrammarCompilePool
from engine.structured_output.errors import StructuredOutputError
from multimodal.audio import AudioError, AudioLimits, load_audio
from multimodal.budget import MediaBudget, MediaReservation
from multimodal.media import (SCHEME, MediaError, MediaLimits, checked_image, finish_decode, open_image,
                              read_audio_source, read_image_source)
from multimodal.processing import ImagePromptProcessor

PromptType = Union[str, list[int], dict[str, Any]]

GRAMMAR_VALIDATE_WAIT_S = 10.0
"""Longest a request's processing waits for its grammar to compile. A slower grammar goes on to the engine
still compiling: the request waits there without holding back the others, and a compile error ends it
there (the same 400)."""


class Processor:
    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, vocab_size: int,
                 eos_token_ids: set[int], lora_enabled: bool, max_n: int = 256,
                 mm_processor: Optional[ImagePromptProcessor] = None,
                 mm_config: Optional[MultiModalConfig] = None, transcriber=None, *,
                 grammar_pool: GrammarCompilePool, adapter_uploads=None, serving: bool = False) -> None:
        self.adapter_uploads = adapter_uploads
        """``lora.adapter_uploads.AdapterUploads`` when LoRA is enabled (``LoRAManager.client_uploads()``):
        reads the adapters requests name here, in the engine's client, once per adapter, and records which
        the engine was sent (the engine's step loop never reads a disk for a request)."""
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.lora_enabled = lora_enabled
        self.max_n = max_n
        """Largest ``n``: one request may not fan out into more samples than can run at once."""
        self.chat_renderer = ChatRenderer(tokenizer, TemplateLimits.for_max_model_len(max_model_len),
                                          takes_images=mm_processor is not None,
                                          takes_audio=takes_audio_prompts(mm_processor))
        """Chat messages -> the template's text and its token ids (the server's and ``LLM.chat``'s)."""
        self.reject_overlong_max_tokens = serving
        """True (``serving``: the HTTP server, as vLLM's): prompt + max_tokens beyond max_model_len is a 400.
        False (offline): max_tokens is capped at the room left and the output ends with 'length'."""
        self.mm_processor = mm_processor
        """Images -> placeholder tokens + encoder inputs; None for a text-only model."""
        self.mm_config = mm_config or MultiModalConfig()
        self.media_budget = MediaBudget(self.mm_config.max_image_pixels_in_flight,
                                        self.mm_config.max_media_bytes_in_flight)
        """Pixels and media bytes of the requests whose media are being loaded, server-wide."""
        self._max_token_chars: Optional[int] = None
        """The longest token's length in characters (``max_token_chars``), found on first use."""
        self.transcriber = transcriber
        """Whisper models: plans and assembles transcriptions (``engine.transcription``); None otherwise."""
        self.grammar_pool = grammar_pool
        """Compiles (and caches) the grammars of constrained requests: the engine's pool in the same process,
        a copy of it in the engine-process mode's API process."""
        self.allow_local_media_paths = not serving
        """Offline: images may be given as plain file paths. Not when ``serving`` (only URLs, and
        ``file://`` only under ``allowed_local_media_path``)."""

    @property
    def media_limits(self) -> MediaLimits:
        c = self.mm_config
        return MediaLimits(allowed_local_media_path=c.allowed_local_media_path,
                           fetch_timeout_s=c.media_fetch_timeout_s, max_image_bytes=c.max_image_bytes,
                           max_image_pixels=c.max_image_pixels,
                           allowed_media_domains=(tuple(c.allowed_media_domains)
                                                  if c.allowed_media_domains is not None else None),
                           allow_private_media_urls=c.allow_private_media_urls)

    @property
    def audio_limits(self) -> AudioLimits:
        c = self.mm_config
        return AudioLimits(max_audio_bytes=c.max_audio_bytes, max_duration_s=c.max_audio_duration_s)

    # ------------------------------------------------------------------ prompts
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Return (prompt text or None, prompt token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (list, tuple)) and len(ids) >= self.max_model_len:
                    raise ValueError(self._too_long_message(f"{len(ids)} tokens long"))
                return prompt.get("prompt"), self._check_ids(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: the prompt cannot be empty.")
            self._refuse_certainly_too_long(prompt)
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)):
            if len(prompt) >= self.max_model_len:
                raise ValueError(self._too_long_message(f"{len(prompt)} tokens long"))
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest token of the vocabulary (as the tokenizer spells it: a byte-level
        token's characters are its bytes, so no token covers more characters of a text than this)."""
        if self._max_token_chars is None:
            try:
                vocab = self.tokenizer.get_vocab()
                self._max_token_chars = max((len(t) for t in vocab), default=1) or 1
            except (AttributeError, NotImplementedError, TypeError):
                self._max_token_chars = 1 << 30   # unknown: texts are always tokenized whole
        return self._max_token_chars

    def _refuse_certainly_too_long(self, text: str) -> None:
        """ValueError for a text beyond ``max_model_len`` tokens, found without tokenizing all of it: a
        text longer than (max_model_len + 1) x ``max_token_chars`` characters is checked by tokenizing only
        that much of its head (cut at a space), which has no more tokens than the whole text."""
        max_chars = (self.max_model_len + 1) * self.max_token_chars
        if len(text) <= max_chars:
            return
        head = text[:max_chars]
        cut = head.rfind(" ", max_chars // 2)
        if cut > 0:
            head = head[:cut]
        num_head_tokens = len(self.tokenizer.encode(head, add_special_tokens=False))
        if num_head_tokens >= self.max_model_len:
            raise ValueError(self._too_long_message(
                f"{len(text)} characters long (its first {len(head)} characters alone are {num_head_tokens} "
                "tokens)"))

    def _too_long_message(self, length: str) -> str:
        return (f"prompt: the prompt is {length}, but this model's maximum context length (max_model_len) is "
                f"{self.max_model_len} tokens, which leaves no room for output.")

    def _check_ids(self, ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt: the prompt cannot be empty.")
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt_token_ids: token ids must be integers, got {t!r}.")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: token id {t} is out of vocabulary (size {self.vocab_size}).")
            out.append(t)
        return out

    # ------------------------------------------------------------------ requests
    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request=None,
                priority: int = 0, arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                cancelled: Optional[threading.Event] = None) -> tuple[Optional[str], list[EngineRequest]]:
        """Validate and tokenize; return (prompt text, one EngineRequest per sample of n).

        ``cancelled``: set by the caller when nobody waits for the result any more (its client left); the
        media not yet read or decoded are skipped then (``ProcessingCancelled``).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: expected a SamplingParams.")
        self.check_n(params.n)
        self.check_structured_outputs(params)   # before any media is read
        text, ids = self.tokenize_prompt(prompt)
        features: list[MultiModalFeature] = []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            ids, features = self.process_media(ids, prompt["multi_modal_data"], cancelled)
        self.check_required_media(features)
        return text, self.make_requests(request_id, text, ids, params, lora_request, priority, arrival_time,
                                        cache_salt, features)

    def check_n(self, n: int) -> None:
        """ValueError unless one prompt's ``n`` samples can run at once (at most ``max_n``)."""
        if n > self.max_n:
            raise ValueError(f"n: at most {self.max_n} samples per request (max_num_seqs), got {n}.")

    def process_media(self, ids: list[int], mm_data: Any, cancelled: Optional[threading.Event] = None,
                      ) -> tuple[list[int], list[MultiModalFeature]]:
        """Load, check and preprocess the prompt's media; expand its placeholders.

        ``mm_data``: ``{"image": one image or a list}`` (vision models) or ``{"audio": one audio or a
        list}`` (Whisper, Qwen2-Audio). An image is a PIL image, bytes, a URL (http(s), data:, file:// under
        ``allowed_local_media_path``) or, offline, a file path; an audio is ``(array, sample_rate)``,
        encoded bytes, a URL (as an image's, ``data:audio/...``), a binary file object or, offline, a file
        path.
        Slow (downloads, decoding, resizing, features): the server runs it off the event loop.

        Images are read and their headers opened first; nothing is decoded unless their pixels fit the
        request's bound (``MultiModalConfig.max_image_pixels_per_request``: ``MediaError``) and the
        server's media budget (``media_budget``: ``MediaBusyError``, retry later), which holds them until
        they are preprocessed.
        """
        if not isinstance(mm_data, dict):
            raise ValueError("multi_modal_data: expected a dict like {'image': image_or_list} or "
                             "{'audio': (array, sample_rate)}.")
        takes = self.mm_processor.modality if self.mm_processor is not None else None
        unknown = sorted(set(mm_data) - {"image", "audio"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r}; this engine takes 'image' "
                             "(vision models) and 'audio' (Whisper).")
        items = mm_data.get(takes) if takes is not None else None
        for modality in sorted(set(mm_data) - {takes}):
            if mm_data[modality] is not None:
                raise ValueError(self._no_modality_message(modality))
        if items is None:
            return ids, []
        if not isinstance(items, (list, tuple)) or (takes == "audio" and _is_audio_pair(items)):
            items = [items]
        if not items:
            return ids, []
        limit = self.mm_config.limit(takes)
        if len(items) > limit:
            raise ValueError(f"multi_modal_data: at most {limit} {takes}(s) per prompt, got {len(items)} "
                             "(raise --limit-mm-per-prompt).")
        reservation = self.media_budget.reservation()
        try:
            opened = [self._numbered(takes, k, len(items), self._open, takes, item, reservation, cancelled)
                      for k, item in enumerate(items)]
            reservation.add(num_pixels=self._count_pixels(opened))
            loaded = [self._numbered(takes, k, len(items), self._load, takes, item, cancelled)
                      for k, item in enumerate(opened)]
            _stop_if(cancelled)
            ids, processed = self.mm_processor.process(ids, loaded)
        finally:
            reservation.release()
        features = [MultiModalFeature(
            modality=it.modality, identifier=it.identifier,
            placeholder=None if it.offset is None else PlaceholderRange(it.offset, it.length), data=it.data,
            num_cross_embeds=it.length if it.offset is None else 0) for it in processed]
        return ids, features

    @staticmethod
    def _numbered(modality: str, k: int, num_items: int, fn, *args):
        """``fn(*args)`` for item ``k``; its media error names the item when there are several."""
        try:
            return fn(*args)
        except (MediaError, AudioError) as e:
            if num_items == 1:
                raise
            raise type(e)(f"{modality} {k + 1} of {num_items}: {e}") from e

    def _open(self, modality: str, item: Any, reservation: MediaReservation,
              cancelled: Optional[threading.Event] = None) -> Any:
        """An item read but not decoded: an image's encoded bytes opened at their header (its size known),
        a PIL image as given, an audio as given (its encoded bytes reserved)."""
        _stop_if(cancelled)
        if modality == "image":
            source = read_image_source(item, self.media_limits, allow_local_paths=self.allow_local_media_paths)
            if isinstance(source, bytes):
                reservation.add(num_bytes=len(source))
                return _OpenedImage(open_image(source, self.media_limits))
            return source
        if isinstance(item, str) and _has_url_scheme(item):   # data:, http(s)://, file:// (guarded)
            try:
                item = read_audio_source(item, self.media_limits, self.mm_config.max_audio_bytes)
            except MediaError as e:
                raise AudioError(f"the audio could not be loaded: {e}") from e
        elif isinstance(item, (str, os.PathLike)) and not self.allow_local_media_paths:
            raise AudioError("audio: file paths are not accepted here; send the audio's bytes or a URL.")
        if isinstance(item, (bytes, bytearray, memoryview)):
            reservation.add(num_bytes=len(item))
        return item

    def _count_pixels(self, opened: list[Any]) -> int:
        """Pixels the opened images decode into, within ``max_image_pixels_per_request`` (else MediaError)."""
        sizes = [item.image.size for item in opened if isinstance(item, _OpenedImage)]
        num_pixels = sum(w * h for w, h in sizes)
        limit = self.mm_config.max_image_pixels_per_request
        if num_pixels > limit:
            raise MediaError(
                f"the request's {len(sizes)} image(s) have {num_pixels} pixels in all "
                f"({', '.join(f'{w}x{h}' for w, h in sizes[:4])}{', ...' if len(sizes) > 4 else ''}), above the "
                f"limit of {limit} per request (--max-image-pixels-per-request); send fewer or smaller images")
        return num_pixels

    def _load(self, modality: str, item: Any, cancelled: Optional[threading.Event] = None):
        """An ``_open``-ed item decoded."""
        _stop_if(cancelled)
        if modality == "image":
            if isinstance(item, _OpenedImage):
                return finish_decode(item.image)
            return checked_image(item, self.media_limits)
        return load_audio(item, self.audio_limits)

    def _no_modality_message(self, modality: str) -> str:
        if self.mm_processor is None:
            return (f"multi_modal_data: this model is text-only and takes no {modality}; serve a vision model "
                    "(LLaVA, Qwen2-VL) for images, or Qwen2-Audio or a Whisper model for audio.")
        return (f"multi_modal_data: this model takes {self.mm_processor.modality}, not {modality}; "
                f"{'serve Qwen2-Audio, or a Whisper model to transcribe audio' if modality == 'audio' else 'serve a vision model for images'}.")

    def check_required_media(self, features: list[MultiModalFeature]) -> None:
        """An encoder-decoder model (Whisper) cannot run a prompt without its input."""
        if getattr(self.mm_processor, "requires_item", False) and not features:
            raise ValueError(f"prompt: this model transcribes {self.mm_processor.modality}; send it with "
                             f"multi_modal_data={{'{self.mm_processor.modality}': ...}} (or use the "
                             "/v1/audio/transcriptions endpoint), a text-only prompt cannot run on it.")

    def make_requests(self, request_id: str, text: Optional[str], ids: list[int], params: SamplingParams,
                      lora_request=None, priority: int = 0, arrival_time: Optional[float] = None,
                      cache_salt: Optional[str] = None,
                      mm_features: Optional[list[MultiModalFeature]] = None) -> list[EngineRequest]:
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt: the prompt is {len(ids)} tokens long, but this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens, which leaves no room for output.")
        self.check_n(params.n)
        max_logprobs = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > max_logprobs:
                raise ValueError(f"{name}: requested {v} logprobs, the maximum is {max_logprobs} "
                                 "(raise --max-logprobs).")
        if lora_request is not None and not self.lora_enabled:
            raise ValueError("model: LoRA adapters are not enabled; start the engine with enable_lora=True.")
        if not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}.")
        room = self.max_model_len - len(ids)
        if self.reject_overlong_max_tokens and params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} "
                "in the completion). Please reduce the length of the prompt or the completion.")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.time() if arrival_time is None else arrival_time
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        lora_request = self.attach_adapter(lora_request)
        mm_features = self.encoder_keyed(list(mm_features or []), lora_request)
        children = []
        for i in range(params.n):
            p = params
            rid = request_id
            if params.n > 1:
                p = params.clone()
                p.n = 1
                if params.seed is not None:
                    p.seed = params.seed + i
                rid = child_request_id(request_id, i)
            children.append(EngineRequest(
                request_id=rid, prompt=text, prompt_token_ids=list(ids), sampling_params=p,
                eos_token_ids=eos, arrival_time=arrival, priority=priority, lora_request=lora_request,
                cache_salt=cache_salt, max_tokens=max_tokens, mm_features=list(mm_features)))
        return children

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's constraint (or find it compiled), waiting up to ``GRAMMAR_VALIDATE_WAIT_S``.
        Raises ``StructuredOutputError`` (its message starting with the field it blames) when it does not
        compile."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        try:
            self.grammar_pool.validate(constraint, param=constraint.param, timeout_s=GRAMMAR_VALIDATE_WAIT_S)
        except StructuredOutputError as e:
            raise e.named() from None
        except concurrent.futures.TimeoutError:
            pass   # still compiling: the engine waits for it

    def attach_adapter(self, lora_request):
        """What a request naming ``lora_request`` sends to the engine: it carrying the adapter, read
        from disk now, the first time this client names that adapter; else it without weights
        (``AdapterUploads.attach``). LoRA errors (4xx) for an adapter that cannot be read."""
        if lora_request is None or self.adapter_uploads is None:
            return lora_request
        return self.adapter_uploads.attach(lora_request)

    def encoder_keyed(self, features: list[MultiModalFeature], lora_request) -> list[MultiModalFeature]:
        """``features`` under their final encoder-cache keys: keyed under the adapter's name and id when the
        request's adapter updates a projection of the model's encoder (its encoder output is its own:
        ``AdapterUploads.adapts_encoder``), else by content alone (the base encoder's output, shared by
        the requests of every other adapter)."""
        if not features or lora_request is None or self.adapter_uploads is None:
            return features
        if not self.adapter_uploads.adapts_encoder(lora_request):
            return features
        return [f.with_encoder_adapter(lora_request.lora_name, lora_request.lora_int_id) for f in features]


CHILD_ID_SEPARATOR = "#"
"""Between a request's id and a sample's index in the ids of an ``n > 1`` request's sequences; outside the
characters a client's request id may have (``[A-Za-z0-9._:-]``), so no client id equals a sequence's."""


def child_request_id(request_id: str, index: int) -> str:
    """The engine id of sample ``index`` of an ``n > 1`` request."""
    return f"{request_id}{CHILD_ID_SEPARATOR}{index}"


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's ``n`` sequences (its own id when ``n == 1``)."""
    return [request_id] if n == 1 else [child_request_id(request_id, i) for i in range(n)]


class ProcessingCancelled(Exception):
    """The caller of ``Processor.process`` set its ``cancelled`` event: the rest of the work was skipped."""


def _stop_if(cancelled: Optional[threading.Event]) -> None:
    if cancelled is not None and cancelled.is_set():
        raise ProcessingCancelled("the request was cancelled while its media were processed")


@dataclass
class _OpenedImage:
    """An image whose header is read and size checked; its pixels are not decoded yet."""

    image: Any
    """The lazily opened PIL image (``multimodal.media.open_image``)."""


def _is_audio_pair(value: Any) -> bool:
    """``(array, sample_rate)``: one decoded audio, not a list of two items."""
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float))
            and not isinstance(value[1], bool) and hasattr(value[0], "shape"))


def takes_audio_prompts(mm_processor: Any) -> bool:
    """The model takes audio inside its prompt (an audio-language model: chat audio parts are accepted), not
    only as an encoder-decoder's input (Whisper)."""
    return (mm_processor is not None and mm_processor.modality == "audio"
            and not getattr(mm_processor, "requires_item", False))


def _has_url_scheme(source: str) -> bool:
    """``source`` names a URL (``data:``, ``http(s)://``, ``file://``...), not a file path; a one-letter
    scheme is a Windows drive."""
    match = SCHEME.match(source[:64])
    return match is not None and len(match[1]) > 1
