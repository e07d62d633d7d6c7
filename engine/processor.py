"""User input -> validated ``EngineRequest``s. Every user error is a ``ValueError`` raised here.

Handles prompt forms (text, token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``, either with
``"multi_modal_data": {"image": ...}``), chat templates, media (loaded, checked, preprocessed and
placed: ``multimodal/``), length checks, the n > 1 fan-out (children share the prompt's KV blocks
through the prefix cache) and adapter checks.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Union

from engine.config import ModelConfig, MultiModalConfig
from engine.request import EngineRequest, MultiModalFeature, PlaceholderRange
from engine.sampling_params import SamplingParams
from multimodal.audio import AudioError, AudioLimits, load_audio
from multimodal.media import MediaError, MediaLimits, load_image
from multimodal.processing import ImagePromptProcessor

PromptType = Union[str, list[int], dict[str, Any]]


class Processor:
    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, vocab_size: int,
                 eos_token_ids: set[int], lora_enabled: bool, max_n: int = 256,
                 mm_processor: Optional[ImagePromptProcessor] = None,
                 mm_config: Optional[MultiModalConfig] = None, transcriber=None) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.lora_enabled = lora_enabled
        self.max_n = max_n
        """Largest ``n``: one request may not fan out into more samples than can run at once."""
        self.chat_template = _read_template(model_config.chat_template)
        self.reject_overlong_max_tokens = False
        """True (the HTTP server, as vLLM's): prompt + max_tokens beyond max_model_len is a 400.
        False (offline): max_tokens is capped at the room left and the output ends with 'length'."""
        self.mm_processor = mm_processor
        """Images -> placeholder tokens + encoder inputs; None for a text-only model."""
        self.mm_config = mm_config or MultiModalConfig()
        self.transcriber = transcriber
        """Whisper models: plans and assembles transcriptions (``engine.transcription``); None otherwise."""
        self.allow_local_media_paths = True
        """Offline: images may be given as plain file paths. The server sets False (only URLs, and
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
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: the prompt cannot be empty.")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}.")

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: at least one message is required.")
        template = _read_template(chat_template) or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("chat_template: the model's tokenizer has no chat template; pass --chat-template.")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, chat_template=template, **kwargs)
        except Exception as e:  # jinja errors on malformed messages are user errors
            raise ValueError(f"messages: the chat template could not render them: {e}") from e

    def encode_chat(self, text: str) -> list[int]:
        # The template already holds the special tokens: don't add BOS again.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ requests
    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request=None,
                priority: int = 0, arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                ) -> tuple[Optional[str], list[EngineRequest]]:
        """Validate and tokenize; return (prompt text, one EngineRequest per sample of n)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: expected a SamplingParams.")
        text, ids = self.tokenize_prompt(prompt)
        features: list[MultiModalFeature] = []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            ids, features = self.process_media(ids, prompt["multi_modal_data"])
        self.check_required_media(features)
        return text, self.make_requests(request_id, text, ids, params, lora_request, priority, arrival_time,
                                        cache_salt, features)

    def process_media(self, ids: list[int], mm_data: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """Load, check and preprocess the prompt's media; expand its placeholders.

        ``mm_data``: ``{"image": one image or a list}`` (vision models) or ``{"audio": one audio or a
        list}`` (Whisper). An image is a PIL image, bytes, a URL (http(s), data:, file:// under
        ``allowed_local_media_path``) or, offline, a file path; an audio is ``(array, sample_rate)``,
        encoded bytes, a binary file object or, offline, a file path.
        Slow (downloads, decoding, resizing, features): the server runs it off the event loop.
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
        loaded = []
        for k, item in enumerate(items):
            try:
                loaded.append(self._load(takes, item))
            except (MediaError, AudioError) as e:
                if len(items) == 1:
                    raise
                raise type(e)(f"{takes} {k + 1} of {len(items)}: {e}") from e
        ids, processed = self.mm_processor.process(ids, loaded)
        features = [MultiModalFeature(
            modality=it.modality, identifier=it.identifier,
            placeholder=None if it.offset is None else PlaceholderRange(it.offset, it.length), data=it.data,
            num_cross_embeds=it.length if it.offset is None else 0) for it in processed]
        return ids, features

    def _load(self, modality: str, item: Any):
        if modality == "image":
            return load_image(item, self.media_limits, allow_local_paths=self.allow_local_media_paths)
        if isinstance(item, (str, os.PathLike)) and not self.allow_local_media_paths:
            raise AudioError("audio: file paths are not accepted here; send the audio's bytes.")
        return load_audio(item, self.audio_limits)

    def _no_modality_message(self, modality: str) -> str:
        if self.mm_processor is None:
            return (f"multi_modal_data: this model is text-only and takes no {modality}; serve a vision model "
                    "(LLaVA, Qwen2-VL) for images or a Whisper model for audio.")
        return (f"multi_modal_data: this model takes {self.mm_processor.modality}, not {modality}; "
                f"{'serve a Whisper model to transcribe audio' if modality == 'audio' else 'serve a vision model for images'}.")

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
        if params.n > self.max_n:
            raise ValueError(f"n: at most {self.max_n} samples per request (max_num_seqs), got {params.n}.")
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
        children = []
        for i in range(params.n):
            p = params
            rid = request_id
            if params.n > 1:
                p = params.clone()
                p.n = 1
                if params.seed is not None:
                    p.seed = params.seed + i
                rid = f"{i}_{request_id}"
            children.append(EngineRequest(
                request_id=rid, prompt=text, prompt_token_ids=list(ids), sampling_params=p,
                eos_token_ids=eos, arrival_time=arrival, priority=priority, lora_request=lora_request,
                cache_salt=cache_salt, max_tokens=max_tokens, mm_features=list(mm_features or [])))
        return children


def _is_audio_pair(value: Any) -> bool:
    """``(array, sample_rate)``: one decoded audio, not a list of two items."""
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float))
            and not isinstance(value[1], bool) and hasattr(value[0], "shape"))


def _read_template(template: Optional[str]) -> Optional[str]:
    """A chat template given as a file path or as the template text."""
    if template is None:
        return None
    if "{" not in template and os.path.exists(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    return template
