"""``--structured-outputs-backend auto|xgrammar|guidance``: building the backend, and ``auto``'s fallback.

``auto`` compiles with xgrammar and falls back to the guidance backend (llguidance) when xgrammar would
not enforce the spec (``XgrammarBackend.unsupported_reason``: JSON schema keywords it ignores) or its
compiler rejects it: e.g. regex ``(?i)abc``, ``\\p{L}+`` or named groups, a Lark grammar
(``start: ...``), a schema ``{"type": "object", "minProperties": 2}`` (xgrammar generates no unlisted
property, so it cannot reach two) or draft-7 tuple ``items: [...]``. When both refuse, the error is the
reason of the backend that was asked last and would have served it (guidance after an unenforced
keyword, xgrammar otherwise). Each backend is built on first use.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

from engine.structured_output.backend import BACKEND_NAMES, CompiledGrammar, StructuredOutputBackend
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.guidance_backend import GuidanceBackend
from engine.structured_output.spec import GrammarSpec
from engine.structured_output.xgrammar_backend import XgrammarBackend


class _Lazy:
    """A backend built on first use, once, under a lock; a failure to build is kept and re-raised."""

    def __init__(self, build: Callable[[], StructuredOutputBackend]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._backend: Optional[StructuredOutputBackend] = None
        self._error: Optional[StructuredOutputError] = None

    def get(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None and self._error is None:
                try:
                    self._backend = self._build()
                except StructuredOutputError as e:
                    self._error = e
            if self._error is not None:
                raise StructuredOutputError(str(self._error), backend=self._error.backend)
            return self._backend


class AutoBackend:
    """xgrammar first, the guidance backend for what xgrammar lacks."""

    name = "auto"

    def __init__(self, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Optional[Sequence[int]] = None) -> None:
        self.vocab_size = int(vocab_size)
        self._xgrammar = _Lazy(lambda: XgrammarBackend(tokenizer, vocab_size, stop_token_ids))
        self._guidance = _Lazy(lambda: GuidanceBackend(tokenizer, vocab_size, stop_token_ids))

    def unsupported_reason(self, spec: GrammarSpec) -> Optional[str]:
        return None

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self._either(spec, lambda backend: backend.compile(spec))

    def check(self, spec: GrammarSpec) -> None:
        self._either(spec, lambda backend: backend.check(spec))

    def _either(self, spec: GrammarSpec, run: Callable[[StructuredOutputBackend], Any]) -> Any:
        """``run`` on xgrammar, or on the guidance backend where xgrammar cannot read the tokenizer, does not
        enforce ``spec`` or fails on it (then xgrammar's error stands where the guidance backend fails too)."""
        try:
            xgrammar = self._xgrammar.get()
        except StructuredOutputError:
            return run(self._guidance.get())
        unenforced = xgrammar.unsupported_reason(spec)
        if unenforced is not None:
            return run(self._guidance.get())
        try:
            return run(xgrammar)
        except StructuredOutputError as xgrammar_error:
            try:
                guidance = self._guidance.get()
                if guidance.unsupported_reason(spec) is not None:
                    raise xgrammar_error
                return run(guidance)
            except StructuredOutputError:
                raise xgrammar_error from None


class UnavailableBackend:
    """A named backend that could not read the model's tokenizer: every compile fails with that reason (a
    400 for each constrained request), and the engine serves its unconstrained requests."""

    def __init__(self, name: str, vocab_size: int, error: StructuredOutputError) -> None:
        self.name = name
        self.vocab_size = int(vocab_size)
        self._error = error
        """Why the backend could not be built."""

    def unsupported_reason(self, spec: GrammarSpec) -> Optional[str]:
        return str(self._error)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        raise StructuredOutputError(str(self._error), backend=self._error.backend)

    def check(self, spec: GrammarSpec) -> None:
        self.compile(spec)


def make_backend(name: str, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Optional[Sequence[int]] = None) -> StructuredOutputBackend:
    """The backend ``name`` (``auto``, ``xgrammar`` or ``guidance``) for ``tokenizer``; the named ones
    read the tokenizer now (``StructuredOutputError`` when they cannot), ``auto`` on first compile."""
    if name == "auto":
        return AutoBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "xgrammar":
        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "guidance":
        return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"structured outputs backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}.")
