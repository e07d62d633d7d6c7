"""POST /v1/chat/completions: messages -> chat template -> tokens -> a reply or SSE chunks.

The messages are rendered and tokenized by the processor's ``ChatRenderer`` (``engine/chat_render.py``,
shared with ``LLM.chat``) in a worker thread; the request's own template, its kwargs and the options
that conflict are checked here first. Image content parts (``image_url``: http(s) or data URLs;
``file://`` under ``--allowed-local-media-path``) render as the model's image placeholder and travel to
the engine client as ``multi_modal_data``; it loads and preprocesses them off the event loop. Every bad
image is a 400 with the reason (``engine/chat_utils.py``, ``multimodal/media.py``). Audio parts (``input_audio``,
``audio_url``) travel the same way to an audio-language model (Qwen2-Audio); bad audio is a 400 too.

Tools and reasoning (vLLM's flags and fields): ``tools`` go to the chat template (assistant
``tool_calls[].function.arguments`` as objects, ``role: tool`` messages as they are); ``tool_choice``
``auto`` reads calls from the reply's text with ``--tool-call-parser`` (``--enable-auto-tool-choice``),
``required`` and a named function constrain the reply by the tools' JSON schemas
(``engine.tool_calls.tool_choice``) and read it with ``ConstrainedToolParser``; a bad choice is a 400
naming ``tools`` or ``tool_choice``. ``--reasoning-parser`` splits the ``<think>`` part off first, into
``reasoning_content``. A reply with calls has ``tool_calls`` and ``finish_reason: "tool_calls"`` (unless
cut by ``length``).

Stream shape (OpenAI's): per choice a first chunk ``delta: {"role": "assistant", "content": ""}``,
then ``delta: {"content": ...}`` chunks (and ``{"reasoning_content": ...}``, ``{"tool_calls": [...]}``
deltas when the reply is parsed), then a chunk with ``delta: {}``, ``finish_reason`` and, when a stop
string or token ended the reply, vLLM's ``stop_reason``; with ``stream_options.include_usage`` every chunk
has ``"usage": null`` and one last chunk has ``"choices": []`` and the usage; then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.chat_render import RenderedChat
from engine.chat_utils import ChatMessageError
from engine.outputs import Logprob
from engine.reasoning.think_tags import ThinkTagReasoningParser, ThinkTagStreamingParser
from engine.request_stream import RequestStream
from engine.server.errors import BadRequestError, error_body, to_openai_error
from engine.server.protocol import (SSE_DONE, ChatCompletionRequest, ChatCompletionResponse,
                                    ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                    ChatMessage, ChatResponseMessage, DeltaMessage, StreamChunkHead,
                                    UsageInfo, now_s, random_id, sse_event, stream_chunk)
from engine.server.serving_base import (OwnedStreamingResponse, ServingBase, merge_streams,
                                        run_unless_disconnected, serialize_prompt_logprobs, to_sampling_params)
from engine.structured_output.params import StructuredOutputsParams
from engine.tool_calls.constrained import ConstrainedToolParser
from engine.tool_calls.parser import StreamingToolParser, ToolParserBase, to_openai_deltas
from engine.tool_calls.tool_choice import (ResolvedToolChoice, ToolChoiceError, resolve_tool_choice,
                                          tool_choice_schema)
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


TOOL_CALLS_FINISH = "tool_calls"
"""``finish_reason`` of a reply that made tool calls (in place of ``stop``)."""


@dataclass(frozen=True)
class ReplyParsing:
    """How one request's replies are read: the reasoning split off first, then tool calls from the rest."""

    reasoning: Optional[ThinkTagReasoningParser] = None
    """``--reasoning-parser``'s parser; None: no reasoning split."""
    tools: Optional[ToolParserBase] = None
    """The tool-call parser for this request (``--tool-call-parser``'s for ``auto``, a
    ``ConstrainedToolParser`` for ``required`` / a named function); None: no calls are read."""
    prompt: str = ""
    """The rendered prompt (where the reply starts: in reasoning or not)."""
    max_calls: Optional[int] = None
    """The calls a reply may report (1 under ``parallel_tool_calls: false``, the first one written);
    None: all."""

    @property
    def active(self) -> bool:
        """The reply text is parsed (not passed through as content)."""
        return self.reasoning is not None or self.tools is not None

    def split(self, text: str, echo: str = "") -> tuple[Optional[str], Optional[str], list[dict[str, Any]]]:
        """A whole reply -> (reasoning_content, content, OpenAI ``tool_calls``); ``echo`` goes before the
        content."""
        reasoning, content = (self.reasoning.extract(text, self.prompt) if self.reasoning is not None
                              else (None, text))
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            extracted = self.tools.extract(content or "")
            content, calls = extracted.content, [c.to_openai() for c in extracted.tool_calls[:self.max_calls]]
        if echo:
            content = echo + (content or "")
        return reasoning, content, calls

    def stream(self) -> ReplyStream:
        """A fresh incremental reader for one streamed reply."""
        return ReplyStream(self.reasoning.streaming(self.prompt) if self.reasoning is not None else None,
                           self.tools.streaming() if self.tools is not None else None, self.max_calls)


class ReplyStream:
    """One streamed reply: text deltas in, OpenAI deltas out (``reasoning_content``, ``content``,
    ``tool_calls``); their concatenation is ``ReplyParsing.split`` of the whole text."""

    def __init__(self, reasoning: Optional[ThinkTagStreamingParser],
                 tools: Optional[StreamingToolParser], max_calls: Optional[int] = None) -> None:
        self.reasoning = reasoning
        """The reasoning split of this reply (None: none)."""
        self.tools = tools
        """The tool-call parser of this reply (None: none)."""
        self.max_calls = max_calls
        """Deltas of calls at this index or later are dropped (None: none are)."""

    @property
    def tools_called(self) -> bool:
        """A call has been streamed."""
        return self.tools is not None and self.tools.tools_called

    def feed(self, text: str) -> list[DeltaMessage]:
        """The deltas ``text`` completes (text that may be a tag is held back)."""
        return self._deltas(text, final=False)

    def finish(self) -> list[DeltaMessage]:
        """The end of the reply: what was held back."""
        return self._deltas("", final=True)

    def _deltas(self, text: str, final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        if self.reasoning is not None:
            split = self.reasoning.finish() if final else self.reasoning.feed(text)
            if split.reasoning:
                out.append(DeltaMessage(reasoning_content=split.reasoning))
            text = split.content or ""
        if self.tools is None:
            if text:
                out.append(DeltaMessage(content=text))
            return out
        pieces = self.tools.feed(text) if text else []
        if final:
            pieces += self.tools.finish()
        if self.max_calls is not None:
            pieces = [p for p in pieces if p.tool_call is None or p.tool_call.index < self.max_calls]
        out.extend(DeltaMessage(**delta) for delta in to_openai_deltas(pieces))
        return out


def reply_finish_reason(finish_reason: Optional[str], tools_called: bool) -> Optional[str]:
    """``tool_calls`` for a reply that made calls and ended by itself (``stop``); else as it is."""
    return TOOL_CALLS_FINISH if tools_called and finish_reason == "stop" else finish_reason


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
                trust_request_chat_template: bool = False,
                tools: Optional[list[dict[str, Any]]] = None) -> RenderedChat:
    """The processor's ``ChatRenderer`` (jinja2's sandbox, bounded in time and size; tokenized once) on a
    request's messages (and ``tools``, the template's ``tools``). Blocking CPU work: the handlers run it
    in a worker thread (``render_chat_off_loop``). Malformed parts and images for a text-only model -> 400
    (param ``messages``), before anything is fetched; template errors -> 400 (param ``chat_template`` for
    the request's template, ``messages`` for the server's)."""
    if add_generation_prompt and continue_final_message:
        raise BadRequestError("Cannot set both continue_final_message and add_generation_prompt to true.",
                              param="continue_final_message")
    check_request_chat_template(chat_template, trust_request_chat_template)
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or {}))
    if reserved:
        raise BadRequestError(f"chat_template_kwargs cannot set {reserved[0]!r}: it is a field of the "
                              "request (or set by the server).", param="chat_template_kwargs")
    try:
        return engine_client.processor.chat_renderer.render(
            [m.model_dump(exclude_none=True) for m in messages], add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, add_special_tokens=add_special_tokens,
            chat_template=chat_template or None, template_kwargs=chat_template_kwargs, tools=tools)
    except ChatMessageError as e:
        raise BadRequestError(str(e), param="messages") from e
    except (ValueError, TypeError, KeyError) as e:   # ChatTemplateError names the field
        raise BadRequestError(f"Could not apply the chat template: {e}",
                              param=getattr(e, "param", "messages")) from e


async def render_chat_off_loop(engine_client: Any, req: Any,
                               trust_request_chat_template: bool) -> RenderedChat:
    """``render_chat`` of a chat request's fields (``ChatCompletionRequest``, ``TokenizeChatRequest``) in a
    worker thread (``RENDER_THREADS``): a slow template or a long conversation never stalls the event loop
    (other streams, /health). The render stops itself at its time bound."""
    check_request_chat_template(req.chat_template, trust_request_chat_template)
    render = functools.partial(
        render_chat, engine_client, req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, add_special_tokens=req.add_special_tokens,
        chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
        trust_request_chat_template=trust_request_chat_template, tools=getattr(req, "tools", None))
    return await asyncio.get_running_loop().run_in_executor(_render_executor, render)


class OpenAIServingChat(ServingBase):

    def __init__(self, engine_client: Any, models: Any, trust_request_chat_template: bool = False, *,
                 tool_parser: Optional[ToolParserBase] = None, enable_auto_tools: bool = False,
                 reasoning_parser: Optional[ThinkTagReasoningParser] = None,
                 reasoning_before_constraint: bool = False) -> None:
        super().__init__(engine_client, models)
        self.trust_request_chat_template = trust_request_chat_template
        """--trust-request-chat-template: a request's own ``chat_template`` (text) is rendered, not
        refused."""
        self.tool_parser = tool_parser
        """--tool-call-parser's parser: reads the calls of ``tool_choice: "auto"`` replies."""
        self.enable_auto_tools = enable_auto_tools and tool_parser is not None
        """--enable-auto-tool-choice (with a parser): ``tool_choice: "auto"`` is served, not a 400."""
        self.reasoning_parser = reasoning_parser
        """--reasoning-parser's parser: splits ``reasoning_content`` off every reply."""
        self.reasoning_before_constraint = reasoning_before_constraint
        """The engine lets a constrained reply (``required`` / named tool choice) reason before its
        constraint applies (it tracks the think tags). Otherwise a constrained reply is the constrained
        text alone, and it is not split for reasoning (a format that starts in reasoning would take all
        of it)."""

    def resolve_tools(self, req: ChatCompletionRequest
                      ) -> tuple[ResolvedToolChoice, Optional[dict[str, Any]]]:
        """The request's tool choice and, for ``required`` / a named function, the JSON schema that
        constrains the reply. BadRequestError (param ``tools``, ``tool_choice``) for a bad one."""
        try:
            choice = resolve_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls,
                                         auto_enabled=self.enable_auto_tools)
            return choice, tool_choice_schema(req.tools, choice)
        except ToolChoiceError as e:
            raise BadRequestError(str(e), param=e.param) from e

    def reply_parsing(self, choice: ResolvedToolChoice, prompt_text: str) -> ReplyParsing:
        """How the replies to one request are read."""
        tools: Optional[ToolParserBase] = None
        reasoning = self.reasoning_parser
        if choice.constrained:
            tools = ConstrainedToolParser(choice.function_name)
            reasoning = reasoning if self.reasoning_before_constraint else None
        elif choice.mode == "auto":
            tools = self.tool_parser
        # NOTE: a constrained `required` reply already holds one call without parallel_tool_calls.
        return ReplyParsing(reasoning, tools, prompt_text, max_calls=None if choice.parallel_tool_calls else 1)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        lora = self.models.resolve_model_name(req.model)
        model_name = self.models.response_model_name(req.model, lora)
        tool_choice, tool_schema = self.resolve_tools(req)
        if req.top_logprobs and not req.logprobs:
            raise BadRequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                                  param="top_logprobs")
        prompt = await render_chat_off_loop(self.engine_client, req, self.trust_request_chat_template)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_sampling_params(req, max_tokens=max_tokens, logprobs=num_top,
                                    defaults=self.engine_client.default_sampling_params)
        if tool_schema is not None:
            if params.structured_outputs is not None:
                raise BadRequestError(f"tool_choice {req.tool_choice!r} constrains the reply to tool calls; "
                                      "it cannot be combined with response_format or structured_outputs.",
                                      param="tool_choice")
            # Compact JSON: every token the model spends is part of a call, so the calls parse whenever the
            # reply ends by itself (with whitespace allowed, a model can loop on it until max_tokens).
            params.structured_outputs = StructuredOutputsParams(json=tool_schema, disable_any_whitespace=True)
        elif tool_choice.mode == "auto" and getattr(self.tool_parser, "needs_special_tokens", False):
            params.skip_special_tokens = False   # the format's tags are special tokens
        parsing = self.reply_parsing(tool_choice, prompt.text)
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
            return OwnedStreamingResponse(self._stream(req, streams[0], request_id, created, model_name, echo,
                                                       parsing),
                                          streams, media_type="text/event-stream")
        body = await run_unless_disconnected(
            raw_request, self._collect(req, streams[0], request_id, created, model_name, echo, parsing))
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
                       created: int, model_name: str, echo: str,
                       parsing: ReplyParsing = ReplyParsing()) -> ChatCompletionResponse:
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
            if parsing.active:
                reasoning, content, calls = parsing.split(ch.text, echo)
                message = ChatResponseMessage(role=ASSISTANT, content=content, reasoning_content=reasoning,
                                              tool_calls=calls)
            else:
                message, calls = ChatResponseMessage(role=ASSISTANT, content=echo + ch.text), []
            resp_choices.append(ChatCompletionResponseChoice(
                index=idx, message=message, logprobs=logprobs,
                finish_reason=reply_finish_reason(ch.finish_reason, bool(calls)), stop_reason=ch.stop_reason))
        return ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=resp_choices,
                                      usage=_usage(num_prompt_tokens, choices),
                                      prompt_logprobs=serialize_prompt_logprobs(prompt_logprobs))

    # ------------------------------------------------------------------------------------
    async def _stream(self, req: ChatCompletionRequest, stream: RequestStream, request_id: str,
                      created: int, model_name: str, echo: str,
                      parsing: ReplyParsing = ReplyParsing()) -> AsyncIterator[str]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        choices = [_Choice() for _ in range(req.n)]
        num_prompt_tokens = 0
        as_ids = bool(req.return_tokens_as_token_ids)

        def chunk(idx: int, delta: DeltaMessage, logprobs: Any = None, finish: Optional[str] = None,
                  stop_reason: Optional[int | str] = None) -> str:
            usage = _usage(num_prompt_tokens, choices) if continuous else None
            return stream_chunk(id=request_id, object="chat.completion.chunk", created=created,
                                model=model_name,
                                choices=[ChatCompletionResponseStreamChoice(index=idx, delta=delta,
                                                                            logprobs=logprobs,
                                                                            finish_reason=finish,
                                                                            stop_reason=stop_reason)],
                                usage=usage, include_usage_key=include_usage)

        head = StreamChunkHead(id=request_id, object="chat.completion.chunk", created=created,
                               model=model_name, include_usage_key=include_usage)
        fast = not req.logprobs and not continuous and not parsing.active
        replies = [parsing.stream() for _ in range(req.n)] if parsing.active else []
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
                    logprobs = (self.chat_logprobs(list(c.token_ids), list(c.logprobs or []),
                                                   req.top_logprobs or 0, as_ids)
                                if req.logprobs and c.token_ids else None)
                    if replies:
                        reply = replies[c.index]
                        deltas = reply.feed(c.text) if c.text else []
                        if c.finish_reason is not None:
                            deltas += reply.finish()
                        if not deltas and logprobs is not None:
                            deltas = [DeltaMessage()]
                        for i, delta in enumerate(deltas):
                            yield chunk(c.index, delta, logprobs if i == 0 else None)
                    elif c.text and fast:
                        yield head.chat_content(c.index, c.text)
                    elif c.text or logprobs is not None:
                        yield chunk(c.index, DeltaMessage(content=c.text), logprobs)
                    if c.finish_reason is not None:
                        ch.finish_reason = c.finish_reason
                        called = bool(replies) and replies[c.index].tools_called
                        yield chunk(c.index, DeltaMessage(), None,
                                    reply_finish_reason(c.finish_reason, called), c.stop_reason)
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
