"""Incremental detokenization: text deltas as tokens arrive, for any HF tokenizer.

Decodes a short window (from ``prefix_offset``) twice per step and emits the difference, so a
token's text may depend on its neighbours (SentencePiece's leading spaces, byte-level BPE's
multi-byte characters) and half-formed characters (U+FFFD) are held back until complete.
"""

from __future__ import annotations

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Seed the window with the prompt's tail so the first output token decodes in context.
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        delta = []
        for tid in new_token_ids:
            self.ids.append(tid)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta.append(new_text[len(prefix_text):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        text = "".join(delta)
        self.output_text += text
        return text


def decode_token(tokenizer, token_id: int) -> str:
    """Text of one token for logprob entries (vLLM's ``decoded_token``)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
