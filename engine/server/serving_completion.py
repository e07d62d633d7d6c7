"""POST /v1/completions: prompts (text, token ids, or lists of either) -> completions or SSE."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request_stream import RequestStream
from engine.outputs import Logprob, RequestOutput
from engine.server.errors import BadRequestError, to_openai_error, error_body
from engine.server.protocol import (SSE_DONE, CompletionRequest, CompletionResponse,
                                    CompletionResponseChoice, CompletionResponseStreamChoice, StreamChunkHead,
                                    UsageInfo, now_s, random_id, sse_event, stream_chunk)
from engine.server.serving_base import (OwnedStreamingResponse, ServingBase, merge_streams,
                                        run_unless_disconnected, serialize_prompt_logprobs, to_sampling_params)


@dataclass
class _Choice:
    """One sample's text so far (non-streaming) or its running text offset (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprob_steps: list[Optional[dict[int, Logprob]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    started: bool = False
    """Streaming: the echo (if any) has been sent."""
    text_offset: int = 0


@dataclass
class _PromptInfo:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


class OpenAIServingCompletion(ServingBase):

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        lora = self.models.resolve_model_name(req.model)
        model_name = self.models.response_model_name(req.model, lora)
        if req.suffix:
            raise BadRequestError("suffix is not currently supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequestError("best_of must equal n (beam search is not supported).", param="best_of")
        prompts = _normalize_prompts(req.prompt)
        num_top = req.logprobs
        params = to_sampling_params(req, max_tokens=req.max_tokens, logprobs=num_top,
                                    prompt_logprobs=num_top if req.echo and num_top is not None else None,
                                    defaults=self.engine_client.default_sampling_params)
        request_id = req.request_id or raw_request.headers.get("X-Request-Id") or random_id("cmpl")
        # A client that leaves while its prompts are processed cancels them (nothing reaches the engine).
        streams = await run_unless_disconnected(
            raw_request, self.submit_all(prompts, params, request_id, lora, req.priority))
        if streams is None:
            return Response(status_code=499)
        created = now_s()
        if req.stream:
            return OwnedStreamingResponse(
                self._stream(req, streams, request_id, created, model_name, len(prompts)), streams,
                media_type="text/event-stream")
        body = await run_unless_disconnected(
            raw_request, self._collect(req, streams, request_id, created, model_name, len(prompts)))
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body.model_dump(mode="json"))

    # ------------------------------------------------------------------------------------
    async def _collect(self, req: CompletionRequest, streams: list[RequestStream], request_id: str,
                       created: int, model_name: str, num_prompts: int) -> CompletionResponse:
        n = req.n
        choices = [_Choice() for _ in range(num_prompts * n)]
        prompts = [_PromptInfo() for _ in range(num_prompts)]
        async for i, out in merge_streams(streams):
            self._note_prompt(prompts[i], out)
            for c in out.outputs:
                ch = choices[i * n + c.index]
                ch.text += c.text
                ch.token_ids += c.token_ids
                if c.logprobs:
                    ch.logprob_steps += c.logprobs
                if c.finish_reason is not None:
                    ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        resp_choices = []
        for idx, ch in enumerate(choices):
            p = prompts[idx // n]
            text, token_ids, steps, offset = ch.text, ch.token_ids, ch.logprob_steps, 0
            if req.echo:
                text = p.text + text
                token_ids = p.token_ids + token_ids
                steps = list(p.logprobs or [None] * len(p.token_ids)) + steps
            logprobs = (self.completion_logprobs(token_ids, steps, req.logprobs, offset,
                                                 bool(req.return_tokens_as_token_ids))
                        if req.logprobs is not None else None)
            prompt_logprobs = (serialize_prompt_logprobs(p.logprobs)
                               if req.prompt_logprobs is not None else None)
            resp_choices.append(CompletionResponseChoice(index=idx, text=text, logprobs=logprobs,
                                                         finish_reason=ch.finish_reason,
                                                         stop_reason=ch.stop_reason,
                                                         prompt_logprobs=prompt_logprobs))
        usage = _usage(prompts, choices)
        return CompletionResponse(id=request_id, created=created, model=model_name, choices=resp_choices,
                                  usage=usage)

    def _note_prompt(self, p: _PromptInfo, out: RequestOutput) -> None:
        if not p.token_ids and out.prompt_token_ids:
            p.token_ids = list(out.prompt_token_ids)
            p.text = out.prompt if out.prompt is not None else self.tokenizer.decode(p.token_ids)
        if out.prompt_logprobs and p.logprobs is None:
            p.logprobs = list(out.prompt_logprobs)

    # ------------------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, streams: list[RequestStream], request_id: str,
                      created: int, model_name: str, num_prompts: int) -> AsyncIterator[str]:
        n = req.n
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        choices = [_Choice() for _ in range(num_prompts * n)]
        prompts = [_PromptInfo() for _ in range(num_prompts)]
        as_ids = bool(req.return_tokens_as_token_ids)
        head = StreamChunkHead(id=request_id, object="text_completion", created=created, model=model_name,
                               include_usage_key=include_usage)
        fast = req.logprobs is None and not continuous
        try:
            async for i, out in merge_streams(streams):
                p = prompts[i]
                self._note_prompt(p, out)
                for c in out.outputs:
                    idx = i * n + c.index
                    ch = choices[idx]
                    text, token_ids = c.text, list(c.token_ids)
                    steps: list[Optional[dict[int, Logprob]]] = list(c.logprobs or [])
                    if req.echo and not ch.started:
                        text = p.text + text
                        token_ids = p.token_ids + token_ids
                        steps = list(p.logprobs or [None] * len(p.token_ids)) + steps
                    ch.started = True
                    ch.token_ids += c.token_ids
                    if c.finish_reason is not None:
                        ch.finish_reason = c.finish_reason
                    if not text and not token_ids and c.finish_reason is None:
                        continue  # as vLLM: a chunk per output with new tokens, even if their text
                        # is still held back (partial UTF-8, a possible stop string)
                    ch.text_offset += len(text)
                    if fast:
                        yield head.completion(idx, text, c.finish_reason, c.stop_reason)
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self.completion_logprobs(token_ids, steps, req.logprobs,
                                                            ch.text_offset - len(text), as_ids)
                    choice = CompletionResponseStreamChoice(index=idx, text=text, logprobs=logprobs,
                                                            finish_reason=c.finish_reason,
                                                            stop_reason=c.stop_reason)
                    yield stream_chunk(id=request_id, object="text_completion", created=created,
                                       model=model_name, choices=[choice],
                                       usage=_usage(prompts, choices) if continuous else None,
                                       include_usage_key=include_usage)
            if include_usage:
                usage = _usage(prompts, choices).model_dump(mode="json", exclude_none=True)
                yield sse_event({"id": request_id, "object": "text_completion", "created": created,
                                 "model": model_name, "choices": [], "usage": usage})
        except Exception as e:  # noqa: BLE001 - reported in-band, as vLLM does
            err = to_openai_error(e)
            yield sse_event(error_body(err.message, err.err_type, err.status_code, err.param))
        yield SSE_DONE


def _usage(prompts: list[_PromptInfo], choices: list[_Choice]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _normalize_prompts(prompt: Any) -> list[Any]:
    """str | list[str] | list[int] | list[list[int]] -> one engine prompt per entry."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("prompt must not be empty.", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    for x in prompt:
        if not isinstance(x, str) and (not isinstance(x, list) or not x):
            raise BadRequestError("prompt must be a string, a list of strings, a list of token ids "
                                  "or a list of non-empty token-id lists.", param="prompt")
    return [x if isinstance(x, str) else list(x) for x in prompt]
