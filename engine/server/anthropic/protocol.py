"""Anthropic Messages API bodies (pydantic): the request of ``POST /v1/messages`` and the ``Message`` reply.

Requests take Anthropic's fields and ignore unknown ones (``cache_control`` on blocks, newer fields);
the request body goes through the same checks as OpenAI requests first (finite numbers, nesting depth,
``stop_sequences`` bounds: ``engine.server.protocol.OpenAIRequest``). Server tools (a ``type`` other than
``custom``) and content blocks other than text, image, tool_use, tool_result and thinking are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import stop_bound_error
from engine.server.protocol import OpenAIRequest, field_error

ImageMediaType = Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- request content blocks ------------------------------------------------------------------------
class TextBlockParam(AnthropicModel):
    type: Literal["text"]
    """The block's kind (every block has one)."""
    text: str
    """The text."""


class Base64ImageSource(AnthropicModel):
    type: Literal["base64"]
    """The source's kind."""
    media_type: ImageMediaType
    """The image's format."""
    data: str
    """The image file, base64."""


class URLImageSource(AnthropicModel):
    type: Literal["url"]
    """The source's kind."""
    url: str
    """An http(s) URL of the image."""


class ImageBlockParam(AnthropicModel):
    type: Literal["image"]
    """The block's kind."""
    source: Annotated[Union[Base64ImageSource, URLImageSource], Field(discriminator="type")]
    """Inline (base64) or by URL."""


class ToolUseBlockParam(AnthropicModel):
    """A call the assistant made (in an assistant message)."""

    type: Literal["tool_use"]
    """The block's kind."""
    id: str
    """The call's id; the ``tool_result`` that answers it names it."""
    name: str
    """The tool's name."""
    input: dict[str, Any]
    """The call's arguments."""


class ToolResultBlockParam(AnthropicModel):
    """A tool's answer to a call (in a user message)."""

    type: Literal["tool_result"]
    """The block's kind."""
    tool_use_id: str
    """The id of the ``tool_use`` it answers."""
    content: Optional[Union[str, list[Annotated[Union[TextBlockParam, ImageBlockParam],
                                                Field(discriminator="type")]]]] = None
    """The result: text, or text and image blocks."""
    is_error: bool = False
    """The tool failed; the result is its error."""


class ThinkingBlockParam(AnthropicModel):
    """Reasoning of an earlier assistant turn, sent back."""

    type: Literal["thinking"]
    """The block's kind."""
    thinking: str
    """The reasoning text."""
    signature: Optional[str] = None
    """Anthropic's signature of the block (not checked here)."""


class RedactedThinkingBlockParam(AnthropicModel):
    """Encrypted reasoning of an earlier turn: accepted and left out."""

    type: Literal["redacted_thinking"]
    """The block's kind."""
    data: str = ""
    """Opaque."""


ContentBlockParam = Annotated[Union[TextBlockParam, ImageBlockParam, ToolUseBlockParam, ToolResultBlockParam,
                                    ThinkingBlockParam, RedactedThinkingBlockParam],
                              Field(discriminator="type")]


class MessageParam(AnthropicModel):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    """Who wrote it (the system prompt is the request's ``system``)."""
    content: Union[str, list[ContentBlockParam]]
    """A string, or content blocks."""


# -- tools ------------------------------------------------------------------------------------------
class ToolParam(AnthropicModel):
    name: str = Field(min_length=1)
    """The function's name."""
    description: Optional[str] = None
    """What it does (the model reads it)."""
    input_schema: dict[str, Any]
    """JSON schema of its input object."""
    type: Optional[str] = None
    """``custom`` (or absent); Anthropic's server tools (``web_search_...``, ``bash_...``) are refused."""

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool {data.get('name')!r}: tool type {kind!r} (an Anthropic server tool) is "
                             "not supported; define it as a custom tool with an input_schema.")
        return data


class ToolChoiceParam(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    """``auto``: the model decides; ``any``: some tool must be called; ``tool``: ``name`` must be called;
    ``none``: no calls."""
    name: Optional[str] = None
    """The tool to call (``type: tool``)."""
    disable_parallel_tool_use: Optional[bool] = None
    """At most one call (``auto``) or exactly one (``any``, ``tool``)."""

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoiceParam:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's 'name'.")
        return self


class ThinkingParam(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    """Passed to the chat template as ``enable_thinking`` (true unless ``disabled``)."""
    budget_tokens: Optional[int] = None
    """Accepted and not enforced: reasoning counts against ``max_tokens``."""


class OutputFormatParam(AnthropicModel):
    type: Literal["json_schema"]
    """The format's kind."""
    json_schema: dict[str, Any] = Field(alias="schema")
    """The JSON schema the reply's text follows (OpenAI's ``response_format`` json_schema)."""


class OutputConfigParam(AnthropicModel):
    format: Optional[OutputFormatParam] = None
    """Structured output."""
    effort: Optional[str] = None
    """Accepted and not used."""


class MetadataParam(AnthropicModel):
    user_id: Optional[str] = None
    """An opaque end-user id (OpenAI's ``user``)."""


class MessagesRequest(OpenAIRequest):
    """POST /v1/messages."""

    model: str
    """Served model name or adapter name (the same selection as chat completions)."""
    messages: list[MessageParam] = Field(min_length=1)
    """The conversation, alternating user and assistant turns."""
    max_tokens: int = Field(ge=1)
    """Most tokens to generate (required, as in Anthropic's API)."""
    system: Optional[Union[str, list[TextBlockParam]]] = None
    """The system prompt."""
    stop_sequences: Optional[list[str]] = None
    """Strings that end the reply (``stop_reason: "stop_sequence"``)."""
    temperature: Optional[float] = Field(default=None, ge=0.0)
    """Sampling temperature (None: 1.0). Newer Anthropic SDKs no longer send the sampling fields; they are
    accepted from those that do."""
    top_p: Optional[float] = None
    """Nucleus sampling."""
    top_k: Optional[int] = None
    """Top-k sampling."""
    stream: bool = False
    """Reply as Anthropic's SSE event sequence."""
    tools: Optional[list[ToolParam]] = None
    """Functions the model may call."""
    tool_choice: Optional[ToolChoiceParam] = None
    """Whether and which tool must be called (None: ``auto`` when there are tools)."""
    metadata: Optional[MetadataParam] = None
    """The end user's id."""
    thinking: Optional[ThinkingParam] = None
    """Reasoning on or off (for templates that switch it)."""
    output_config: Optional[OutputConfigParam] = None
    """Structured output of the reply's text."""

    @classmethod
    def check_bounds(cls, data: Any) -> None:
        """``stop_sequences`` within ``engine.sampling_params``' bounds (before a long list is walked)."""
        if isinstance(data, dict):
            bound = stop_bound_error(data.get("stop_sequences"), None)
            if bound is not None:
                raise field_error("stop_sequences", bound[1].replace("stop has", "stop_sequences has", 1))


# -- the reply ----------------------------------------------------------------------------------------
class TextBlock(AnthropicModel):
    type: Literal["text"] = "text"
    """The block's kind."""
    text: str
    """The reply's text."""


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"] = "tool_use"
    """The block's kind."""
    id: str
    """The call's id (the ``tool_use_id`` of its ``tool_result``)."""
    name: str
    """The tool called."""
    input: dict[str, Any]
    """The call's arguments."""


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"] = "thinking"
    """The block's kind."""
    thinking: str
    """The reply's reasoning (``--reasoning-parser``)."""
    signature: str = ""
    """Empty: reasoning is not signed here."""


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ThinkingBlock], Field(discriminator="type")]


class Usage(AnthropicModel):
    """Token counts of the request."""

    input_tokens: int
    """Prompt tokens."""
    output_tokens: int
    """Generated tokens."""


class Message(AnthropicModel):
    """The reply of a non-streamed request (and, empty, the ``message`` of ``message_start``)."""

    id: str
    """``msg_...``."""
    type: Literal["message"] = "message"
    """Always ``message``."""
    role: Literal["assistant"] = "assistant"
    """Always ``assistant``."""
    content: list[ContentBlock] = Field(default_factory=list)
    """Thinking, text and tool_use blocks, in that order."""
    model: str
    """The model (or adapter) that replied."""
    stop_reason: Optional[StopReason] = None
    """None only in ``message_start``."""
    stop_sequence: Optional[str] = None
    """The stop sequence that ended the reply (``stop_reason: "stop_sequence"``)."""
    usage: Usage
