"""Incremental detokenization: the DecodeStream fast path and the window path give the text that
``tokenizer.decode`` gives, token by token, including multi-byte characters and special tokens."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from tests.conftest import build_tokenizer

TEXT = "Hello world! Paged attention, caf\u00e9 \u4e16\u754c \U0001f600 <|im_end|> SELECT name; 42."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_decode(tok, fast, skip_special):
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt, out = ids[:4], ids[4:]
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special)
    if not fast:
        d._stream = None
    assert (d._stream is not None) == fast
    pieces = [d.step([t]) for t in out[:-3]] + [d.step(out[-3:])]
    assert all("\ufffd" not in p for p in pieces)                 # half characters are held back
    full = tok.decode(ids, skip_special_tokens=skip_special)
    assert full == tok.decode(prompt, skip_special_tokens=skip_special) + "".join(pieces)
