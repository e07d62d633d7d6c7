"""POST /v1/chat/completions: messages -> chat template -> tokens -> a reply or SSE chunks.

Image content parts (``image_url``: http(s) or data URLs; ``file://`` under
``--allowed-local-media-path``) render as the model's image placeholder and travel to the engine
client as ``multi_modal_data``; it loads and preprocesses them off the event loop. Every bad image
is a 400 with the reason (``engine/chat_utils.py``, ``multimodal/media.py``).

Stream shape (OpenAI's): per choice a first chunk ``delta: {"role": "assistant", "content": ""}``,
then ``delta: {"content": ...}`` chunks, then a chunk with ``delta: {}`` and ``finish_reason``;
with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one last chunk has
``"choices": []`` and the usage; then ``data: [DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.async_llm import RequestStream
from engine.chat_utils import ParsedChat, parse_chat_messages
from engine.outputs import Logprob
from engine.server.errors import BadRequestError, error_body, to_openai_error
from engine.server.protocol import (SSE_DONE, ChatCompletionRequest, ChatCompletionResponse,
                                    ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                    ChatMessage, ChatResponseMessage, DeltaMessage, StreamChunkHead,
                                    UsageInfo, now_s, random_id, sse_event, stream_chunk)
from engine.server.serving_base import (ServingBase, merge_streams, run_unless_disconnected,
                                        serialize_prompt_logprobs, to_sampling_params)
from multimodal.media import MediaError

ASSISTANT = "assistant"


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    logprob_token_ids: list[int] = field(default_factory=list)
    logprob_steps: list[Optional[dict[int, Logprob]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


@dataclass
class ChatPrompt:
    """A rendered conversation, ready for the engine."""

    text: str
    """The templated conversation (one image placeholder per image)."""
    token_ids: list[int]
    """What the engine gets (tokenized here so the template's own special tokens are not doubled)."""
    images: list[str] = field(default_factory=list)
    """The conversation's image URLs in placeholder order (loaded by the engine client, off the
    event loop)."""

    def engine_prompt(self) -> dict[str, Any]:
        """The engine client's prompt dict (with ``multi_modal_data`` when there are images)."""
        prompt: dict[str, Any] = {"prompt": self.text, "prompt_token_ids": self.token_ids}
        if self.images:
            prompt["multi_modal_data"] = {"image": list(self.images)}
        return prompt


def parse_messages(engine_client: Any, messages: list[ChatMessage]) -> ParsedChat:
    """pydantic messages -> template messages + image URLs (``engine/chat_utils.py``). Malformed
    parts and images for a text-only model -> 400 (param ``messages``), before anything is fetched."""
    takes_images = getattr(engine_client.processor, "mm_processor", None) is not None
    try:
        return parse_chat_messages([m.model_dump(exclude_none=True) for m in messages],
                                   takes_images=takes_images)
    except ValueError as e:
        raise BadRequestError(str(e), param="messages") from e


def render_chat(engine_client: Any, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool, chat_template: Optional[str],
                chat_template_kwargs: Optional[dict[str, Any]]) -> ChatPrompt:
    """Apply the chat template and tokenize. Template errors -> 400."""
    if add_generation_prompt and continue_final_message:
        raise BadRequestError("Cannot set both continue_final_message and add_generation_prompt to true.",
                              param="continue_final_message")
    parsed = parse_messages(engine_client, messages)
    try:
        text = engine_client.apply_chat_template(
            parsed.messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except (ValueError, TypeError, KeyError) as e:
        raise BadRequestError(f"Could not apply the chat template: {e}", param="messages") from e
    except Exception as e:  # jinja2 TemplateError and friends
        if type(e).__module__.startswith("jinja2"):
            raise BadRequestError(f"Could not apply the chat template: {e}", param="messages") from e
        raise
    token_ids = engine_client.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ChatPrompt(text=text, token_ids=list(token_ids), images=parsed.images)


class OpenAIServingChat(ServingBase):

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        lora = self.models.resolve_model_name(req.model)
        model_name = self.models.response_model_name(req.model, lora)
        if req.tools and req.tool_choice not in (None, "none"):
            raise BadRequestError("Tool calling is not supported by Chorus.", param="tool_choice")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise BadRequestError("response_format other than 'text' (structured output) is not supported "
                                  "by Chorus.", param="response_format")
        if req.top_logprobs and not req.logprobs:
            raise BadRequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                                  param="top_logprobs")
        prompt = render_chat(self.engine_client, req.messages,
                             add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             add_special_tokens=req.add_special_tokens, chat_template=req.chat_template,
                             chat_template_kwargs=req.chat_template_kwargs)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_sampling_params(req, max_tokens=max_tokens, logprobs=num_top,
                                    defaults=self.engine_client.default_sampling_params)
        request_id = req.request_id or raw_request.headers.get("X-Request-Id") or random_id("chatcmpl")
        try:
            streams = await self.submit_all([prompt.engine_prompt()], params, request_id, lora, req.priority)
        except MediaError as e:   # loading / decoding an image failed: say so, and where it came from
            raise BadRequestError(f"An image could not be loaded: {e}", param="messages") from e
        created = now_s()
        echo = self._echo_text(req)
        if req.stream:
            return StreamingResponse(self._stream(req, streams[0], request_id, created, model_name, echo),
                                     media_type="text/event-stream")
        body = await run_unless_disconnected(
            raw_request, self._collect(req, streams[0], request_id, created, model_name, echo))
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body.model_dump(mode="json"))

    @staticmethod
    def _echo_text(req: ChatCompletionRequest) -> str:
        """vLLM's chat ``echo``: the last message's content, when it has the reply's role."""
        if not req.echo or not req.messages or req.messages[-1].role != ASSISTANT:
            return ""
        content = req.messages[-1].content
        if isinstance(content, list):
            return "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
        return content or ""

    # ------------------------------------------------------------------------------------
    async def _collect(self, req: ChatCompletionRequest, stream: RequestStream, request_id: str,
                       created: int, model_name: str, echo: str) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(req.n)]
        num_prompt_tokens = 0
        prompt_logprobs = None
        async for _, out in merge_streams([stream]):
            num_prompt_tokens = len(out.prompt_token_ids or [])
            if out.prompt_logprobs and prompt_logprobs is None:
                prompt_logprobs = list(out.prompt_logprobs)
            for c in out.outputs:
                ch = choices[c.index]
                ch.text += c.text
                ch.num_tokens += len(c.token_ids)
                if c.logprobs:
                    ch.logprob_token_ids += c.token_ids
                    ch.logprob_steps += c.logprobs
                if c.finish_reason is not None:
                    ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        as_ids = bool(req.return_tokens_as_token_ids)
        resp_choices = []
        for idx, ch in enumerate(choices):
            logprobs = (self.chat_logprobs(ch.logprob_token_ids, ch.logprob_steps, req.top_logprobs or 0,
                                           as_ids) if req.logprobs else None)
            resp_choices.append(ChatCompletionResponseChoice(
                index=idx, message=ChatResponseMessage(role=ASSISTANT, content=echo + ch.text),
                logprobs=logprobs, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason))
        return ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=resp_choices,
                                      usage=_usage(num_prompt_tokens, choices),
                                      prompt_logprobs=serialize_prompt_logprobs(prompt_logprobs))

    # ------------------------------------------------------------------------------------
    async def _stream(self, req: ChatCompletionRequest, stream: RequestStream, request_id: str,
                      created: int, model_name: str, echo: str) -> AsyncIterator[str]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        choices = [_Choice() for _ in range(req.n)]
        num_prompt_tokens = 0
        as_ids = bool(req.return_tokens_as_token_ids)

        def chunk(idx: int, delta: DeltaMessage, logprobs: Any = None, finish: Optional[str] = None) -> str:
            usage = _usage(num_prompt_tokens, choices) if continuous else None
            return stream_chunk(id=request_id, object="chat.completion.chunk", created=created,
                                model=model_name,
                                choices=[ChatCompletionResponseStreamChoice(index=idx, delta=delta,
                                                                            logprobs=logprobs,
                                                                            finish_reason=finish)],
                                usage=usage, include_usage_key=include_usage)

        head = StreamChunkHead(id=request_id, object="chat.completion.chunk", created=created,
                               model=model_name, include_usage_key=include_usage)
        fast = not req.logprobs and not continuous
        first = True
        try:
            async for _, out in merge_streams([stream]):
                num_prompt_tokens = len(out.prompt_token_ids or [])
                if first:  # as vLLM: the role chunks go out with the first output (TTFT stays honest)
                    first = False
                    for idx in range(req.n):
                        yield chunk(idx, DeltaMessage(role=ASSISTANT, content=""))
                        if echo:
                            yield chunk(idx, DeltaMessage(content=echo))
                for c in out.outputs:
                    ch = choices[c.index]
                    ch.num_tokens += len(c.token_ids)
                    if c.text and fast:
                        yield head.chat_content(c.index, c.text)
                    elif c.text or (c.token_ids and req.logprobs):
                        logprobs = (self.chat_logprobs(list(c.token_ids), list(c.logprobs or []),
                                                       req.top_logprobs or 0, as_ids)
                                    if req.logprobs else None)
                        yield chunk(c.index, DeltaMessage(content=c.text), logprobs)
                    if c.finish_reason is not None:
                        ch.finish_reason = c.finish_reason
                        yield chunk(c.index, DeltaMessage(), None, c.finish_reason)
            if include_usage:
                usage = _usage(num_prompt_tokens, choices).model_dump(mode="json", exclude_none=True)
                yield sse_event({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                 "model": model_name, "choices": [], "usage": usage})
        except Exception as e:  # noqa: BLE001 - reported in-band, as vLLM does
            err = to_openai_error(e)
            yield sse_event(error_body(err.message, err.err_type, err.status_code, err.param))
        yield SSE_DONE


def _usage(num_prompt_tokens: int, choices: list[_Choice]) -> UsageInfo:
    completion_tokens = sum(c.num_tokens for c in choices)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=num_prompt_tokens + completion_tokens)
