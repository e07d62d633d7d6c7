"""The protocols every constrained-decoding backend implements, and the names of the backends.

A backend compiles a ``GrammarSpec`` once (``compile``) into a ``CompiledGrammar`` shared by every
request with that spec; each request gets its own ``GrammarMatcher`` (``CompiledGrammar.new_matcher``),
which follows the request's output token by token and writes the allowed next tokens into one row of
the host bitmask (``engine.structured_output.bitmask``: ``[rows, ceil(vocab_size / 32)]`` int32, bit
``i % 32`` of word ``i // 32`` set = token ``i`` allowed).
"""

from __future__ import annotations

from typing import Literal, Optional, Protocol, Sequence

import torch

from engine.structured_output.spec import GrammarSpec

BackendName = Literal["auto", "xgrammar", "guidance"]
"""``--structured-outputs-backend``: ``auto`` compiles with xgrammar and falls back to the guidance
backend (llguidance) for what xgrammar lacks (``engine.structured_output.selection``)."""
BACKEND_NAMES: tuple[str, ...] = ("auto", "xgrammar", "guidance")
"""The accepted values of ``BackendName``."""
ALLOW_ALL = -1
"""An int32 bitmask word with every bit set: all 32 tokens allowed."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar. Not thread-safe: one owner (the scheduler side)."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``: True when the grammar allows them all; otherwise False and the
        matcher is where it was (none of them accepted). A terminated matcher accepts nothing."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a stop token included; it un-terminates)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``bitmask``: ``[rows, words]`` int32,
        on the host, contiguous). A terminated matcher allows every token (the request should have
        finished; the grammar no longer constrains it)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended and a stop token was accepted."""
        ...

    def reset(self) -> None:
        """Back to the start of the grammar (no token accepted)."""
        ...


class CompiledGrammar(Protocol):
    """A compiled spec, immutable and shared between requests and threads."""

    backend: str
    """The backend that compiled it (``xgrammar`` or ``guidance``; never ``auto``)."""
    spec: GrammarSpec
    """What was compiled."""

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        ...


class StructuredOutputBackend(Protocol):
    """A grammar library bound to one tokenizer and vocabulary size."""

    name: str
    """``xgrammar``, ``guidance`` or ``auto``."""
    vocab_size: int
    """The width of the model's logits: the bitmask covers ``ceil(vocab_size / 32) * 32`` ids; ids the
    tokenizer does not have (padding) are never allowed."""

    def unsupported_reason(self, spec: GrammarSpec) -> Optional[str]:
        """Why this backend would not enforce ``spec`` faithfully (a feature it lacks or ignores), found
        without compiling; None when it should. ``compile`` raises with this reason."""
        ...

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``. Raises ``StructuredOutputError`` with the compiler's reason."""
        ...

    def check(self, spec: GrammarSpec) -> None:
        """Parse ``spec`` without compiling it against the tokenizer (a small fraction of a compile): raises
        ``StructuredOutputError`` with the compiler's reason where ``compile`` would for the spec itself."""
        ...


def fill_allow_all(bitmask: torch.Tensor, row: int) -> None:
    """Allow every token in ``bitmask[row]``."""
    bitmask[row].fill_(ALLOW_ALL)
