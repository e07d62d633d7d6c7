"""What completions and chat share: request -> SamplingParams, submitting (with rollback),
merging several requests' streams, logprob formatting, and cancel-on-disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.async_llm import AsyncLLM
from engine.outputs import Logprob, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.server.errors import BadRequestError
from engine.server.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                    ChatCompletionLogProbsContent, CompletionLogProbs, SamplingFields)
from engine.server.serving_models import OpenAIServingModels

logger = logging.getLogger("chorus.server")

T = TypeVar("T")

MIN_LOGPROB = -9999.0
"""JSON has no -inf; OpenAI and vLLM clamp to this."""


def to_sampling_params(req: SamplingFields, *, max_tokens: Optional[int], logprobs: Optional[int],
                       prompt_logprobs: Optional[int] = None, defaults: Optional[dict] = None) -> SamplingParams:
    """Request fields -> SamplingParams (DELTA outputs). ValueError naming the field -> 400.

    Fields the request leaves unset take the checkpoint's generation_config values (``defaults``),
    then OpenAI's defaults, as vLLM does.
    """
    d = defaults or {}

    def pick(value, name: str, fallback):
        return value if value is not None else d.get(name, fallback)

    if req.logit_bias:
        raise BadRequestError("logit_bias is not supported by Chorus.", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("Stream options can only be defined when `stream=True`.",
                              param="stream_options")
    return SamplingParams(
        n=req.n,
        presence_penalty=req.presence_penalty if req.presence_penalty is not None else 0.0,
        frequency_penalty=req.frequency_penalty if req.frequency_penalty is not None else 0.0,
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
        temperature=pick(req.temperature, "temperature", 1.0),
        top_p=pick(req.top_p, "top_p", 1.0),
        top_k=pick(req.top_k, "top_k", 0),
        min_p=pick(req.min_p, "min_p", 0.0),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=req.structured_outputs_params(),
    )


class ServingBase:
    """Shared by ``OpenAIServingCompletion`` and ``OpenAIServingChat``."""

    def __init__(self, engine_client: AsyncLLM, models: OpenAIServingModels) -> None:
        self.engine_client = engine_client
        self.models = models

    @property
    def tokenizer(self) -> Any:
        return self.engine_client.tokenizer

    async def submit_all(self, prompts: list[Any], params: SamplingParams, base_request_id: str,
                         lora_request: Any, priority: int) -> list[RequestStream]:
        """Add one engine request per prompt, all or none.

        The prompts x n sequences are admitted at once before any prompt is processed (``ValueError``, a
        400 naming ``n`` or ``prompt``, when they could never fit; ``EngineOverloadedError``, a 503, when
        they do not fit now). If any request is rejected, or this call is cancelled (its client left), the
        others are aborted, those still being processed included.
        """
        client = self.engine_client
        client.processor.check_n(params.n)
        reservation = client.reserve_sequences(len(prompts) * params.n,
                                               param="prompt" if len(prompts) > 1 else "n")
        ids = ([base_request_id] if len(prompts) == 1
               else [f"{base_request_id}-{i}" for i in range(len(prompts))])
        # All adds are queued before the first await, so the engine takes them in one go.
        tasks = [asyncio.ensure_future(client.add_request(prompt, params.clone() if i else params, rid,
                                                          lora_request=lora_request, priority=priority,
                                                          reservation=reservation))
                 for i, (prompt, rid) in enumerate(zip(prompts, ids, strict=True))]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for task in tasks:   # a request added meanwhile is aborted once its task is done
                task.add_done_callback(_abort_added)
            raise
        finally:
            reservation.release()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    r.abort()
            raise errors[0]
        return list(results)

    def token_str(self, token_id: int, lp: Optional[Logprob], as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], steps: list[Optional[dict[int, Logprob]]],
                            num_top: int, text_offset: int, as_ids: bool = False) -> CompletionLogProbs:
        """Legacy completions shape; ``text_offset`` is where the first token's text starts."""
        out = CompletionLogProbs()
        for i, token_id in enumerate(token_ids):
            step = steps[i] if i < len(steps) else None
            if step is None:  # the first prompt token (echo) has no logprob
                token = self.token_str(token_id, None, as_ids)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                token = self.token_str(token_id, step.get(token_id), as_ids)
                out.token_logprobs.append(_clamp(step[token_id].logprob) if token_id in step else None)
                top = {token: out.token_logprobs[-1]} if token_id in step else {}
                for tid, lp in _top_n(step, num_top):
                    top.setdefault(self.token_str(tid, lp, as_ids), _clamp(lp.logprob))
                out.top_logprobs.append(top)
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    def chat_logprobs(self, token_ids: list[int], steps: list[Optional[dict[int, Logprob]]],
                      num_top: int, as_ids: bool = False) -> ChatCompletionLogProbs:
        content = []
        for i, token_id in enumerate(token_ids):
            step = steps[i] if i < len(steps) and steps[i] is not None else {}
            token = self.token_str(token_id, step.get(token_id), as_ids)
            lp = step.get(token_id)
            top = [ChatCompletionLogProb(token=(t := self.token_str(tid, p, as_ids)),
                                         logprob=_clamp(p.logprob), bytes=_utf8(t))
                   for tid, p in _top_n(step, num_top)]
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=_clamp(lp.logprob) if lp is not None else MIN_LOGPROB,
                bytes=_utf8(token), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)


def serialize_prompt_logprobs(steps: Optional[list[Optional[dict[int, Logprob]]]]) -> Optional[list]:
    """vLLM's ``prompt_logprobs`` field: per prompt token None or
    {token_id: {logprob, rank, decoded_token}}."""
    if steps is None:
        return None
    return [None if step is None else {
        tid: {"logprob": _clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in step.items()} for step in steps]


def _top_n(step: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    if not n:
        return []
    items = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                                  -kv[1].logprob))
    return items[:n]


def _clamp(x: float) -> float:
    return max(float(x), MIN_LOGPROB) if not math.isnan(x) else MIN_LOGPROB


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _abort_added(task: "asyncio.Future[RequestStream]") -> None:
    """Done-callback of an ``add_request`` task whose caller left: abort the stream it opened, if any."""
    if not task.cancelled() and task.exception() is None:
        task.result().abort()


class OwnedStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that aborts its requests' streams when the response ends, however it ends:
    also when the client is gone before the body generator's first chunk (the generator never starts
    then, and its own ``finally`` never runs)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.streams = streams
        """Aborted when the response ends (a no-op for a stream that already ended)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.abort()


# ----------------------------------------------------------------------------------------
# Streams
# ----------------------------------------------------------------------------------------
@dataclass
class _Done:
    """A request's stream ended (normally or with ``error``)."""

    error: Optional[BaseException] = None


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt_index, output)`` from several request streams as they arrive.

    Closing this generator (or an exception) aborts every request that has not finished.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
            merged.put_nowait((i, _Done()))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            merged.put_nowait((i, _Done(e)))
        finally:
            stream.abort()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def listen_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(raw_request: Request, work: Awaitable[T]) -> Optional[T]:
    """Await ``work`` but cancel it (aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(listen_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # client gone (or we were cancelled): abort the engine requests
            task.cancel()
            logger.info("Client disconnected; request cancelled.")
            with contextlib.suppress(asyncio.CancelledError):
                await task   # let the cancellation run (its finally blocks abort the requests)
    return None if task.cancelled() else task.result()
