"""The pre-rendered SSE chunks (``StreamChunkHead``) equal the pydantic ones byte for byte."""

from __future__ import annotations

import pytest

from engine.server.protocol import (ChatCompletionResponseStreamChoice, CompletionResponseStreamChoice,
                                    DeltaMessage, StreamChunkHead, stream_chunk)


@pytest.mark.parametrize("include_usage_key", [False, True])
@pytest.mark.parametrize("text, finish, stop", [("hello", None, None),
                                                ('q"uo\\te\n\u00e9\u4e16 \ud83d\ude00', None, None),
                                                ("", "stop", "##"), ("x", "stop", 7), ("", "length", None)])
def test_completion_chunk_matches_pydantic(include_usage_key, text, finish, stop):
    common = dict(id="cmpl-1\"x", object="text_completion", created=123, model="tiny/llama \u00e9",
                  include_usage_key=include_usage_key)
    head = StreamChunkHead(**common)
    ref = stream_chunk(**common, usage=None, choices=[CompletionResponseStreamChoice(
        index=3, text=text, logprobs=None, finish_reason=finish, stop_reason=stop)])
    assert head.completion(3, text, finish, stop) == ref


@pytest.mark.parametrize("include_usage_key", [False, True])
@pytest.mark.parametrize("content", ["hi", "\u00e9\n\t\"", " "])
def test_chat_chunk_matches_pydantic(include_usage_key, content):
    common = dict(id="chatcmpl-9", object="chat.completion.chunk", created=5, model="m",
                  include_usage_key=include_usage_key)
    ref = stream_chunk(**common, usage=None, choices=[ChatCompletionResponseStreamChoice(
        index=1, delta=DeltaMessage(content=content), logprobs=None, finish_reason=None)])
    assert StreamChunkHead(**common).chat_content(1, content) == ref
