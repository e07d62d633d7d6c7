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

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request_stream import RequestStream
from engine.chat_utils import ParsedChat, parse_chat_messages
from engine.outputs import Logprob
from engine.server.errors import BadRequestError, error_body, to_openai_error
from engine.server.protocol import (SSE_DONE, ChatCompletionRequest, ChatCompletionResponse,
                                    ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                    ChatMessage, ChatResponseMessage, DeltaMessage, StreamChunkHead,
                                    UsageInfo, now_s, random_id, sse_event, stream_chunk)
from engine.server.serving_base import (OwnedStreamingResponse, ServingBase, merge_streams,
                                        run_unless_disconnected, serialize_prompt_logprobs, to_sampling_params)
from multimodal.media import MediaError

ASSISTANT = "assistant"
RENDER_THREADS = 4
"""Worker threads that render chat templates (and tokenize the result): a burst of slow templates, each
stopped at its time bound, occupies these and never the event loop or the default executor."""
_render_executor = ThreadPoolExecutor(max_workers=RENDER_THREADS, thread_name_prefix="chorus-chat-template")


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


_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "messages", "add_generation_prompt",
                                       "continue_final_message"})
"""What ``chat_template_kwargs`` may not carry: the request's own fields (a ``chat_template`` there would
bypass --trust-request-chat-template)."""


def check_request_chat_template(chat_template: Optional[str], trust_request_chat_template: bool) -> None:
    """A request's ``chat_template`` (template text, never a path) is accepted only when the server runs
    with ``--trust-request-chat-template``; empty or None means the server's template."""
    if chat_template and not trust_request_chat_template:
        raise BadRequestError("This server does not accept a chat_template in requests; leave it out to use "
                              "the model's template (the server operator can allow request templates with "
                              "--trust-request-chat-template).", param="chat_template")


def render_chat(engine_client: Any, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool, chat_template: Optional[str],
                chat_template_kwargs: Optional[dict[str, Any]],
                trust_request_chat_template: bool = False) -> ChatPrompt:
    """Apply the chat template (jinja2's sandbox, bounded in time and size: ``engine/chat_template.py``)
    and tokenize. Blocking CPU work: the handlers run it in a worker thread (``render_chat_off_loop``).
    Template errors -> 400 (param ``chat_template`` for the request's template, ``messages`` for the
    server's)."""
    if add_generation_prompt and continue_final_message:
        raise BadRequestError("Cannot set both continue_final_message and add_generation_prompt to true.",
                              param="continue_final_message")
    check_request_chat_template(chat_template, trust_request_chat_template)
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or {}))
    if reserved:
        raise BadRequestError(f"chat_template_kwargs cannot set {reserved[0]!r}: it is a field of the "
                              "request (or set by the server).", param="chat_template_kwargs")
    parsed = parse_messages(engine_client, messages)
    try:
        text = engine_client.apply_chat_template(
            parsed.messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template or None,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except (ValueError, TypeError, KeyError) as e:   # ChatTemplateError names the field
        raise BadRequestError(f"Could not apply the chat template: {e}",
                              param=getattr(e, "param", "messages")) from e
    token_ids = engine_client.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ChatPrompt(text=text, token_ids=list(token_ids), images=parsed.images)


async def render_chat_off_loop(engine_client: Any, req: Any, trust_request_chat_template: bool) -> ChatPrompt:
    """``render_chat`` of a chat request's fields (``ChatCompletionRequest``, ``TokenizeChatRequest``) in a
    worker thread (``RENDER_THREADS``): a slow template or a long conversation never stalls the event loop
    (other streams, /health). The render stops itself at its time bound."""
    check_request_chat_template(req.chat_template, trust_request_chat_template)
    render = functools.partial(
        render_chat, engine_client, req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, add_special_tokens=req.add_special_tokens,
        chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
        trust_request_chat_template=trust_request_chat_template)
    return await asyncio.get_running_loop().run_in_executor(_render_executor, render)


class OpenAIServingChat(ServingBase):

    def __init__(self, engine_client: Any, models: Any, trust_request_chat_template: bool = False) -> None:
        super().__init__(engine_client, models)
        self.trust_request_chat_template = trust_request_chat_template
        """--trust-request-chat-template: a request's own ``chat_template`` (text) is rendered, not
        refused."""

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
        prompt = await render_chat_off_loop(self.engine_client, req, self.trust_request_chat_template)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_sampling_params(req, max_tokens=max_tokens, logprobs=num_top,
                                    defaults=self.engine_client.default_sampling_params)
        request_id = req.request_id or raw_request.headers.get("X-Request-Id") or random_id("chatcmpl")
        try:   # a client that leaves while its images are processed cancels them (nothing reaches the engine)
            streams = await run_unless_disconnected(
                raw_request, self.submit_all([prompt.engine_prompt()], params, request_id, lora, req.priority))
        except MediaError as e:   # loading / decoding an image failed: say so, and where it came from
            raise BadRequestError(f"An image could not be loaded: {e}", param="messages") from e
        if streams is None:
            return Response(status_code=499)
        created = now_s()
        echo = self._echo_text(req)
        if req.stream:
            return OwnedStreamingResponse(self._stream(req, streams[0], request_id, created, model_name, echo),
                                          streams, media_type="text/event-stream")
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
