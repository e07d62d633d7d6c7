"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests allow unknown fields (ignored, as vLLM does) so newer clients keep working. Responses
are dumped by the serving code; stream chunks go through ``sse_chunk`` so their shape matches
OpenAI's byte for byte (compact JSON, ``usage`` only when asked for, empty ``delta`` at the end).

Before any field is validated, a request body is walked once, without recursion: every string must be
encodable, every number finite (JSON's NaN and Infinity literals are refused), and lists and objects
nest at most ``MAX_JSON_DEPTH`` deep; a failure is a 400 whose ``param`` is the top-level field.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import stop_bound_error
from engine.structured_output.errors import PARAM_RESPONSE_FORMAT, StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams

MAX_JSON_DEPTH = 64
"""Levels of lists and objects a request body may nest (the body itself is the first): deeper bodies
would exhaust the recursion of the code that walks them (templates, tokenizers, pydantic)."""
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""What a client-chosen request id (the ``request_id`` field, the ``X-Request-Id`` header) may be: 1 to
128 characters that cannot break a log line or collide with the engine's internal child ids (``#``)."""
REQUEST_ID_RULE = "1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':' and '-'"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def request_id_error(value: str) -> Optional[str]:
    """Why ``value`` cannot be a client-chosen request id (``REQUEST_ID_PATTERN``); None when it can."""
    if REQUEST_ID_PATTERN.fullmatch(value):
        return None
    return f"must be {REQUEST_ID_RULE} (got {len(value)} characters)."


_SCALARS = (bool, int, type(None))
"""JSON values that need no check."""


def field_error(param: Optional[str], message: str) -> PydanticCustomError:
    """A validation error raised before the fields are validated, naming the offending top-level field:
    errors.py reports ``ctx.param`` as the OpenAI error's ``param``."""
    return PydanticCustomError("invalid_body", "{detail}", {"detail": message, "param": param})


def _value_error(field: Optional[str], message: str) -> PydanticCustomError:
    return field_error(field, f"{field}: {message}" if field else message)


def check_body_values(data: Any) -> None:
    """``PydanticCustomError`` (a 400) naming the top-level field for a string UTF-8 cannot carry (a lone
    surrogate, "\\ud800": tokenizers would raise a TypeError later), a non-finite number, or lists and
    objects nested deeper than ``MAX_JSON_DEPTH``. Iterative: any depth is walked without recursion."""
    stack: list[tuple[Any, int, Optional[str]]] = [(data, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, _SCALARS):
            continue
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise _value_error(field, f"strings must be valid Unicode: {value[e.start:e.end]!r} at "
                                         f"position {e.start} is a lone surrogate.") from None
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _value_error(field, f"numbers must be finite, got {value} (NaN and Infinity are not "
                                         "accepted).")
        elif isinstance(value, (dict, list, tuple)):
            if depth > MAX_JSON_DEPTH:
                raise _value_error(field, f"lists and objects may nest at most {MAX_JSON_DEPTH} levels deep.")
            if isinstance(value, dict):
                for key, item in value.items():   # a dict's keys too
                    name = key if field is None and isinstance(key, str) else field
                    stack.append((key, depth + 1, name))
                    stack.append((item, depth + 1, name))
            else:
                stack.extend((item, depth + 1, field) for item in value if not isinstance(item, _SCALARS))


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIRequest(OpenAIBaseModel):
    """A request body: checked by ``check_body_values`` (and the class's ``check_bounds``) before its
    fields are validated; float fields refuse NaN and Infinity."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        cls.check_bounds(data)
        check_body_values(data)
        return data

    @classmethod
    def check_bounds(cls, data: Any) -> None:
        """Size bounds checked first, on the raw body (before it is walked): none here."""


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False
    """Send one extra chunk (``choices: []``) with the request's usage before ``[DONE]``."""
    continuous_usage_stats: Optional[bool] = False
    """vLLM extension: every chunk carries the usage so far."""


class SamplingFields(OpenAIRequest):
    """Sampling fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: Optional[str] = None
    """Served model name or adapter name; None means the base model."""
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    """None: 1.0 (OpenAI's default)."""
    top_p: Optional[float] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    priority: int = 0
    request_id: Optional[str] = None
    """vLLM extension: the id to use for this request (default: a random one)."""
    return_tokens_as_token_ids: Optional[bool] = None
    """vLLM extension: logprob tokens spelled ``token_id:{id}``."""
    response_format: Optional[dict[str, Any]] = None
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    "strict"}}`` (and vLLM's ``structural_tag``): the reply follows it (constrained decoding)."""
    structured_outputs: Optional[dict[str, Any]] = None
    """vLLM extension: ``{"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}``
    (``engine.structured_output.params.StructuredOutputsParams``); not with ``response_format``."""

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """``structured_outputs`` or ``response_format`` as the engine's constraint (None: neither).
        ``StructuredOutputError`` (a 400 naming the field) for a malformed one; whether it compiles is the
        engine's processor's call."""
        try:
            from_format = StructuredOutputsParams.from_response_format(self.response_format)
            if self.structured_outputs is None:
                return from_format
            if from_format is not None:
                raise StructuredOutputError("response_format cannot be combined with structured_outputs; "
                                            "send one constraint.", param=PARAM_RESPONSE_FORMAT)
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        except StructuredOutputError as e:
            raise e.named() from None

    @classmethod
    def check_bounds(cls, data: Any) -> None:
        """``stop`` and ``stop_token_ids`` within ``engine.sampling_params``' bounds (checked before a long
        list is walked or validated)."""
        if isinstance(data, dict):
            bound = stop_bound_error(data.get("stop"), data.get("stop_token_ids"))
            if bound is not None:
                raise field_error(*bound)

    @field_validator("request_id")
    @classmethod
    def _check_request_id(cls, value: Optional[str]) -> Optional[str]:
        why = None if value is None else request_id_error(value)
        if why is not None:
            raise ValueError(why)
        return value


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    """An assistant turn's calls (``{"id", "type": "function", "function": {"name", "arguments"}}``); the
    chat template gets each call's ``arguments`` as an object."""
    tool_call_id: Optional[str] = None
    """A ``role: tool`` message: the id of the call it answers."""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    """Deprecated by OpenAI in favour of max_completion_tokens; None: up to the context length."""
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    """Function tools (``{"type": "function", "function": {"name", "description", "parameters"}}``): given
    to the chat template; the reply's calls come back as ``tool_calls``."""
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    """``none``, ``auto`` (the default with tools; needs --enable-auto-tool-choice), ``required`` or a
    named function ``{"type": "function", "function": {"name": ...}}``; the last two constrain the reply
    by the tools' JSON schemas."""
    parallel_tool_calls: Optional[bool] = None
    """None or true: a reply may make several calls; false: at most one."""
    # vLLM extras
    echo: bool = False
    """Prepend the last message's content to the reply (when it has the reply's role)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeCompletionRequest(OpenAIRequest):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(OpenAIRequest):
    model: Optional[str] = None
    messages: list[ChatMessage]
    tools: Optional[list[dict[str, Any]]] = None
    """Function tools, given to the chat template (as in a chat request)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TranscriptionRequest(OpenAIRequest):
    """The text fields of POST /v1/audio/transcriptions and /v1/audio/translations (multipart form);
    the upload itself (``file``) is read apart."""

    model: Optional[str] = None
    """The Whisper model's served name (or an adapter's); None: the Whisper model."""
    language: Optional[str] = None
    """ISO-639-1 code or English name of the speech; None: English on English-only models, detected on
    multilingual ones."""
    prompt: Optional[str] = None
    """Text to condition every 30 s window on (earlier transcript, spellings)."""
    response_format: str = "json"
    """json, text, verbose_json, srt or vtt (``transcription_formats.RESPONSE_FORMATS``)."""
    temperature: Optional[float] = None
    """Sampling temperature; None: 0 (greedy)."""
    timestamp_granularities: list[str] = Field(default_factory=list)
    """The form's ``timestamp_granularities[]`` values: "segment" ("word" is refused)."""
    stream: bool = False
    """SSE ``transcript.text.delta`` / ``transcript.text.done`` events (json and text formats)."""


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIRequest):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ----------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------
class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    """vLLM extension: the stop token id or stop string that ended the sample."""
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    """The reply's reasoning (``<think>`` part) with ``--reasoning-parser``; None otherwise."""
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    """The reply's calls, OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    """The next piece of the reasoning (``--reasoning-parser``)."""
    tool_calls: Optional[list[dict[str, Any]]] = None
    """Tool-call deltas: ``{"index", "id", "type", "function": {"name", "arguments"}}`` in a call's first
    delta, then ``{"index", "function": {"arguments"}}`` pieces."""


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    """vLLM extension, on the finishing chunk only: the stop token id or stop string that ended the
    sample (left out of the chunk when None)."""


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=now_s)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "chorus"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------
# SSE framing
# ----------------------------------------------------------------------------------------
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""One encoder: ``json.dumps`` with non-default options builds a new one per call."""
_json_str = json.encoder.encode_basestring
"""A str as a JSON string literal (what ``dumps`` gives for a str), in C."""


def dumps(obj: Any) -> str:
    """Compact JSON, as OpenAI and vLLM send it."""
    return _COMPACT_JSON.encode(obj)


def _json_scalar(value: Optional[Union[int, str]]) -> str:
    if value is None:
        return "null"
    return _json_str(value) if isinstance(value, str) else dumps(value)


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_chunk(*, id: str, object: str, created: int, model: str, choices: list[BaseModel],
                 usage: Optional[UsageInfo], include_usage_key: bool) -> str:
    """One ``data:`` line. Choices dump all their fields (nulls included) except a delta's unset
    ones, so the first chat delta is ``{"role":"assistant","content":""}`` and the last ``{}``.
    ``usage`` is present (``null`` on content chunks) only when the client asked for usage."""
    payload: dict[str, Any] = {"id": id, "object": object, "created": created, "model": model,
                               "choices": [_dump_choice(c) for c in choices]}
    if include_usage_key:
        payload["usage"] = usage.model_dump(mode="json") if usage is not None else None
    return sse_event(payload)


class StreamChunkHead:
    """One stream's chunks without pydantic: the constant head (id, object, created, model) is
    encoded once, then each text chunk costs one ``json.dumps`` of its text. Byte for byte what
    ``stream_chunk`` gives for a choice without logprobs (``test_protocol`` checks it)."""

    def __init__(self, *, id: str, object: str, created: int, model: str, include_usage_key: bool) -> None:
        self._head = (f'data: {{"id":{dumps(id)},"object":{dumps(object)},"created":{int(created)},'
                      f'"model":{dumps(model)},"choices":[')
        self._tail = '],"usage":null}\n\n' if include_usage_key else ']}\n\n'

    def completion(self, index: int, text: str, finish_reason: Optional[str],
                   stop_reason: Optional[Union[int, str]]) -> str:
        """A ``text_completion`` chunk: ``CompletionResponseStreamChoice`` with ``logprobs: null``."""
        return (f'{self._head}{{"index":{index},"text":{_json_str(text)},"logprobs":null,'
                f'"finish_reason":{_json_scalar(finish_reason)},"stop_reason":{_json_scalar(stop_reason)}}}'
                f'{self._tail}')

    def chat_content(self, index: int, content: str) -> str:
        """A ``chat.completion.chunk`` with ``delta: {"content": ...}``, no logprobs, not finished."""
        return (f'{self._head}{{"index":{index},"delta":{{"content":{_json_str(content)}}},"logprobs":null,'
                f'"finish_reason":null}}{self._tail}')


def _dump_choice(choice: BaseModel) -> dict[str, Any]:
    out = choice.model_dump(mode="json")
    if isinstance(choice, ChatCompletionResponseStreamChoice):
        out["delta"] = choice.delta.model_dump(mode="json", exclude_none=True)
        if choice.logprobs is None:
            out["logprobs"] = None
        if choice.stop_reason is None:
            del out["stop_reason"]
    return out
