"""A scripted model behind a real server: ``ScriptedReplies`` replaces the engine client's ``add_request`` so
that each request's reply is a given text, streamed in pieces of given sizes as the engine streams DELTA
outputs. Everything else (HTTP, validation, the chat template, reply parsing, SSE) is the real server's;
the requests' prompts and sampling params are recorded.

For replies a random checkpoint cannot write: tool calls in a parser's format, think tags.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from tests.server.conftest import RunningServer, wait_until

PROMPT_TOKEN_IDS = [1, 2, 3, 4, 5]
"""The prompt tokens every scripted request reports (usage)."""


@dataclass
class ScriptedRequest:
    """One request the scripted engine received."""

    prompt: dict[str, Any]
    """The processor's prompt dict (``prompt``: the rendered chat text)."""
    params: SamplingParams
    """Its sampling params (``structured_outputs``, ``skip_special_tokens``, ...)."""
    request_id: str
    """Its id."""


class _ScriptedStream:
    """A ``RequestStream`` stand-in: the reply's pieces as DELTA ``RequestOutput``s, one per sample."""

    def __init__(self, request_id: str, text: str, piece_sizes: Sequence[int], n: int,
                 finish_reason: str, stop_reason: Any) -> None:
        self.request_id = request_id
        self.text = text
        self.piece_sizes = piece_sizes
        self.n = n
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    async def __aiter__(self):
        sizes = itertools.cycle(self.piece_sizes)
        pieces, at = [], 0
        while at < len(self.text):
            size = next(sizes)
            pieces.append(self.text[at:at + size])
            at += size
        pieces = pieces or [""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            outputs = [CompletionOutput(index=k, text=piece, token_ids=[7], cumulative_logprob=None,
                                        logprobs=None, finish_reason=self.finish_reason if last else None,
                                        stop_reason=self.stop_reason if last else None)
                       for k in range(self.n)]
            yield RequestOutput(self.request_id, None, list(PROMPT_TOKEN_IDS), None, outputs, finished=last)
            await asyncio.sleep(0)


@dataclass
class ScriptedReplies:
    """``with ScriptedReplies(server, ["reply 1", ...]):`` requests get the replies in order (the last one
    repeats), each streamed in pieces of ``piece_sizes`` characters (cycled)."""

    server: RunningServer
    replies: list[str]
    piece_sizes: Sequence[int] = (3,)
    finish_reason: str = "stop"
    stop_reason: Optional[Any] = None
    requests: list[ScriptedRequest] = field(default_factory=list)
    """What was received, in order."""

    def __enter__(self) -> ScriptedReplies:
        client = self.server.engine_client

        async def add_request(prompt: Any, params: SamplingParams, request_id: str, lora_request: Any = None,
                              priority: int = 0, reservation: Any = None) -> _ScriptedStream:
            self.requests.append(ScriptedRequest(prompt, params, request_id))
            text = self.replies[min(len(self.requests), len(self.replies)) - 1]
            return _ScriptedStream(request_id, text, self.piece_sizes, params.n, self.finish_reason,
                                   self.stop_reason)

        client.add_request = add_request
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.server.engine_client.add_request

    @property
    def last(self) -> ScriptedRequest:
        """The latest request received."""
        return self.requests[-1]


def assert_idle(srv: RunningServer) -> None:
    """The engine holds nothing: no request tracked, running or waiting, no KV block, no sequence
    reserved."""
    client = srv.engine_client
    assert wait_until(lambda: client.num_tracked_requests == 0 and client.num_sequences_in_flight == 0)
    assert wait_until(lambda: client.get_stats().num_running_reqs == 0)
    stats = client.get_stats()
    assert stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
