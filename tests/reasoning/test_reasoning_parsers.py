"""--reasoning-parser qwen3 | deepseek_r1: the split of whole replies (by where the prompt leaves the reply),
streamed deltas that reassemble to exactly that split for every way of splitting the reply, and where
reasoning ends, over text and over token ids."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.reasoning.parser import ReasoningSplit, ReasoningState, ThinkTagIds
from engine.reasoning.registry import REASONING_PARSERS, get_reasoning_parser
from engine.reasoning.think_tags import ReasoningTokenTracker

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                    suppress_health_check=[HealthCheck.too_slow])
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
"""A thinking template's prompt (Qwen3-Thinking, R1): the reply starts inside reasoning."""
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""Qwen3 with enable_thinking false: the reply is content."""
PLAIN_PROMPT = "<|im_start|>assistant\n"

CASES = [
    # parser, prompt, reply, (reasoning_content, content)
    ("qwen3", PLAIN_PROMPT, "<think>\nstep 1\n</think>\n\nParis.", ("\nstep 1\n", "\n\nParis.")),
    ("qwen3", PLAIN_PROMPT, "Paris.", (None, "Paris.")),
    ("qwen3", PLAIN_PROMPT, "<think>still thinking", ("still thinking", None)),     # cut short
    ("qwen3", PLAIN_PROMPT, "Use <think> tags</think> like this",
     (None, "Use <think> tags</think> like this")),
    ("qwen3", None, "reasoning</think>answer", (None, "reasoning</think>answer")),
    ("qwen3", OPEN_PROMPT, "reasoning</think>answer", ("reasoning", "answer")),
    ("qwen3", OPEN_PROMPT, "<think>reasoning</think>answer", ("reasoning", "answer")),
    ("qwen3", OPEN_PROMPT, "no end", ("no end", None)),
    ("qwen3", CLOSED_PROMPT, "<think>x</think>Paris.", (None, "<think>x</think>Paris.")),
    ("qwen3", PLAIN_PROMPT, "<think></think>", (None, None)),
    ("deepseek_r1", PLAIN_PROMPT, "thinking</think>answer", ("thinking", "answer")),
    ("deepseek_r1", None, "<think>thinking</think>answer", ("thinking", "answer")),
    ("deepseek_r1", None, "all thinking", ("all thinking", None)),
    ("deepseek_r1", OPEN_PROMPT, "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", None, "x<think>y</think>z", ("x<think>y", "z")),
    ("deepseek_r1", CLOSED_PROMPT, "answer", (None, "answer")),
    ("deepseek_r1", None, "", (None, None)),
]


def _stream(name, prompt, deltas):
    s = get_reasoning_parser(name).streaming(prompt)
    out = [s.feed(d) for d in deltas] + [s.finish()]
    reasoning = "".join(d.reasoning or "" for d in out)
    content = "".join(d.content or "" for d in out)
    return ReasoningSplit(reasoning or None, content or None), out


@pytest.mark.parametrize("name, prompt, reply, expected", CASES)
def test_extract(name, prompt, reply, expected):
    parser = get_reasoning_parser(name)
    assert parser.extract(reply, prompt) == ReasoningSplit(*expected)
    assert oracle(reply, parser.initial_state(prompt)) == ReasoningSplit(*expected)


@pytest.mark.parametrize("name, prompt, reply, expected", CASES)
def test_every_split_reassembles(name, prompt, reply, expected):
    for cut in range(len(reply) + 1):
        assert _stream(name, prompt, [reply[:cut], reply[cut:]])[0] == ReasoningSplit(*expected), cut
    split, deltas = _stream(name, prompt, list(reply))
    assert split == ReasoningSplit(*expected)
    assert all(d.reasoning != "" and d.content != "" for d in deltas)    # nothing empty: None


def test_initial_state_reads_the_prompt_tail():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3.initial_state(None) is ReasoningState.BEFORE
    assert qwen3.initial_state(PLAIN_PROMPT) is ReasoningState.BEFORE
    assert qwen3.initial_state(OPEN_PROMPT) is ReasoningState.IN
    assert qwen3.initial_state(CLOSED_PROMPT) is ReasoningState.AFTER
    # an earlier turn's reasoning does not decide: only the prompt's end does
    assert qwen3.initial_state("<think>a</think>b<|im_start|>assistant\n") is ReasoningState.BEFORE
    assert r1.initial_state(None) is ReasoningState.IN
    assert r1.initial_state(CLOSED_PROMPT) is ReasoningState.AFTER


FRAGMENTS = ["<think>", "</think>", "<thi", "nk>", "</", "<", ">", "think", "a", " ", "\n", "answer"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", [None, PLAIN_PROMPT, OPEN_PROMPT, CLOSED_PROMPT])
@SETTINGS
@given(data=st.data())
def test_random_replies_reassemble_under_random_splits(name, prompt, data):
    reply = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=25), label="fragments"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=8), label="cuts"))
    deltas = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
    parser = get_reasoning_parser(name)
    expected = parser.extract(reply, prompt)
    assert expected == oracle(reply, parser.initial_state(prompt))
    assert _stream(name, prompt, deltas)[0] == expected


def oracle(reply: str, state: ReasoningState) -> ReasoningSplit:
    """The rules of engine/reasoning/think_tags.py, written over the whole reply."""
    if reply.startswith("<think>") and state is not ReasoningState.AFTER:
        reply, state = reply[len("<think>"):], ReasoningState.IN
    if state is not ReasoningState.IN:
        return ReasoningSplit(None, reply or None)
    reasoning, tag, content = reply.partition("</think>")
    return ReasoningSplit(reasoning or None, content or None) if tag else ReasoningSplit(reply or None, None)


TAGS = ThinkTagIds(start=7, end=8)
"""Token ids of <think> and </think> in the token-id tests."""


@pytest.mark.parametrize("name, prompt, reply, ids", [
    ("qwen3", PLAIN_PROMPT, "<think>a b</think>c", [7, 1, 2, 8, 3]),
    ("qwen3", PLAIN_PROMPT, "Paris", [5]),
    ("qwen3", OPEN_PROMPT, "a</think>b", [1, 8, 2]),
    ("qwen3", OPEN_PROMPT, "<think>a</think>b", [7, 1, 8, 2]),
    ("qwen3", CLOSED_PROMPT, "x", [4]),
    ("deepseek_r1", None, "a b", [1, 2]),
    ("deepseek_r1", None, "<think>a</think>", [7, 1, 8]),
])
def test_reasoning_ended_text_and_ids_agree_at_every_prefix(name, prompt, reply, ids):
    """Text and token ids (each tag one token) agree at every token boundary."""
    parser = get_reasoning_parser(name)
    # rebuild the reply token by token so text prefixes line up with id prefixes
    token_texts = reply_tokens(reply)
    assert len(token_texts) == len(ids)
    tracker = ReasoningTokenTracker(TAGS, parser.initial_state(prompt))
    for n in range(len(ids) + 1):
        by_text = parser.reasoning_ended("".join(token_texts[:n]), prompt)
        assert parser.reasoning_ended(ids[:n], prompt, TAGS) == by_text, n
        if n:
            assert tracker.feed(ids[n - 1:n]) == by_text, n


def reply_tokens(reply: str) -> list[str]:
    """The reply cut at the tags and at spaces (a space stays with the word before it)."""
    out, rest = [], reply
    while rest:
        for tag in ("<think>", "</think>"):
            if rest.startswith(tag):
                out.append(tag)
                rest = rest[len(tag):]
                break
        else:
            cut = min([i for i in (rest.find("<think>"), rest.find("</think>"), rest.find(" ") + 1) if i > 0]
                      or [len(rest)])
            out.append(rest[:cut])
            rest = rest[cut:]
    return out


def test_streaming_state_and_incremental_output():
    s = get_reasoning_parser("qwen3").streaming(PLAIN_PROMPT)
    assert s.feed("<thi") == (None, None) and s.state is ReasoningState.BEFORE
    assert s.feed("nk>Let me") == ("Let me", None) and s.state is ReasoningState.IN
    assert s.feed(" see</th") == (" see", None) and not s.reasoning_ended
    assert s.feed("ink>\n\nParis") == (None, "\n\nParis") and s.reasoning_ended
    assert s.finish() == (None, None)


def test_tag_ids_and_registry():
    parser = get_reasoning_parser("qwen3")
    assert parser.tag_ids({"<think>": 151667, "</think>": 151668, "a": 1}) == ThinkTagIds(151667, 151668)
    with pytest.raises(ValueError, match="no single token for </think>"):
        parser.tag_ids({"<think>": 1})
    with pytest.raises(ValueError, match="needs the tags' ids"):
        parser.reasoning_ended([1, 2])
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match=r"Unknown reasoning parser 'r1'.*deepseek_r1, qwen3"):
        get_reasoning_parser("r1")
