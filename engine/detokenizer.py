"""Incremental detokenization: text deltas as tokens arrive, for any HF tokenizer.

Fast tokenizers (a Rust ``tokenizers.Tokenizer`` behind them, no clean-up of tokenization spaces)
use ``tokenizers``' ``DecodeStream``: one Rust call per token instead of two ``tokenizer.decode``
calls. Others decode a short window (from ``prefix_offset``) twice per token
and emit the difference. Either way a token's text may depend on its neighbours (SentencePiece's
leading spaces, byte-level BPE's multi-byte characters), half-formed characters (U+FFFD) are held
back until complete, and the stream is seeded with the prompt's tail so the first output token
decodes in context.
"""

from __future__ import annotations

from typing import Any, Optional

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._backend = _rust_backend(tokenizer)
        self._stream: Optional[Any] = None
        """``tokenizers.decoders.DecodeStream`` (fast path), or None (window decoding)."""
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for tid in context:
                self._stream.step(self._backend, tid)
        # Window decoding state (slow path).
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        if self._stream is not None:
            stream, backend = self._stream, self._backend
            if len(new_token_ids) == 1:
                return stream.step(backend, new_token_ids[0]) or ""
            return "".join(stream.step(backend, tid) or "" for tid in new_token_ids)
        delta = []
        for tid in new_token_ids:
            self.ids.append(tid)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta.append(new_text[len(prefix_text):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        return "".join(delta)


def _rust_backend(tokenizer) -> Optional[Any]:
    """The tokenizer's Rust ``tokenizers.Tokenizer`` when streaming through it gives the same text
    as ``tokenizer.decode`` (no clean-up pass over the decoded string), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) else None


def decode_token(tokenizer, token_id: int) -> str:
    """Text of one token for logprob entries (vLLM's ``decoded_token``)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
