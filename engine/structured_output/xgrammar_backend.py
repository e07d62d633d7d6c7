"""The xgrammar backend: JSON schema, regex, choice, GBNF/EBNF grammar and structural tags, compiled by
xgrammar's ``GrammarCompiler`` (which keeps its own cache of compiled grammars) and followed per request
by an ``xgrammar.GrammarMatcher`` (rollback is unbounded)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional, Sequence

import torch

from engine.structured_output.backend import fill_allow_all
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.json_schema_features import xgrammar_unenforced
from engine.structured_output.spec import GrammarKind, GrammarSpec

NAME = "xgrammar"
"""The backend's name in ``--structured-outputs-backend`` and errors."""
_LOG_PREFIX = re.compile(r"^\s*\[\d{2}:\d{2}:\d{2}\]\s+\S+:\d+:\s*")
"""The ``[hh:mm:ss] file.cc:line:`` prefix of xgrammar's C++ error messages."""
DEFAULT_CACHE_LIMIT_BYTES = 256 << 20
"""Bytes of compiled grammars xgrammar's own compiler cache keeps."""


def compiler_reason(exc: BaseException) -> str:
    """The reason in an xgrammar exception, without the C++ source location."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    text = " ".join(line for line in lines if line)
    return text or type(exc).__name__


class XgrammarMatcher:
    """``GrammarMatcher`` over an ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        """The ``xgrammar.GrammarMatcher``."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        accepted = 0
        for token_id in token_ids:
            ok = False
            if not self._matcher.is_terminated():
                try:
                    ok = self._matcher.accept_token(int(token_id))
                except (RuntimeError, ValueError, TypeError, OverflowError):  # an id outside the vocabulary
                    ok = False
            if not ok:
                if accepted:
                    self._matcher.rollback(accepted)
                return False
            accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            fill_allow_all(bitmask, row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def reset(self) -> None:
        self._matcher.reset()


class XgrammarGrammar:
    """A compiled ``xgrammar.CompiledGrammar``."""

    backend = NAME

    def __init__(self, spec: GrammarSpec, compiled: Any) -> None:
        self.spec = spec
        """What was compiled."""
        self.compiled = compiled
        """The ``xgrammar.CompiledGrammar``."""

    def new_matcher(self) -> XgrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(self.compiled))


class XgrammarBackend:
    """xgrammar bound to one tokenizer. ``compile`` is thread-safe (the compile pool calls it from its
    workers)."""

    name = NAME

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Optional[Sequence[int]] = None,
                 max_threads: Optional[int] = None,
                 cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES) -> None:
        """
        Args:
            tokenizer: a Hugging Face tokenizer.
            vocab_size: the width of the model's logits (at least the tokenizer's size; the ids past
                the tokenizer's are never allowed).
            stop_token_ids: the ids that end the output once the grammar is complete; None: the
                tokenizer's EOS.
            max_threads: threads one compilation may use; None: up to 8, at most the CPU count.
            cache_limit_bytes: bytes of xgrammar's own cache of compiled grammars.

        Raises:
            StructuredOutputError: xgrammar cannot read this tokenizer.
        """
        import xgrammar as xgr

        self.vocab_size = int(vocab_size)
        try:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        except Exception as e:  # the library raises many types for an unreadable tokenizer
            raise StructuredOutputError(f"xgrammar cannot read this model's tokenizer: {compiler_reason(e)}",
                                        backend=NAME) from None
        threads = max_threads if max_threads is not None else max(1, min(8, os.cpu_count() or 1))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True,
                                             cache_limit_bytes=cache_limit_bytes)
        self.stop_token_ids: list[int] = list(info.stop_token_ids)
        """The ids the matcher accepts to end the output."""

    def unsupported_reason(self, spec: GrammarSpec) -> Optional[str]:
        if spec.kind is GrammarKind.JSON:
            found = xgrammar_unenforced(spec.value())
            if found:
                return f"xgrammar does not enforce the JSON schema's {', '.join(found)}."
        return None

    def compile(self, spec: GrammarSpec) -> XgrammarGrammar:
        return XgrammarGrammar(spec, self._build(spec, self._compiler))

    def check(self, spec: GrammarSpec) -> None:
        import xgrammar as xgr

        self._build(spec, xgr.Grammar)

    def _build(self, spec: GrammarSpec, builder: Any) -> Any:
        """``spec`` through ``builder``: the compiler (a compiled grammar) or ``xgrammar.Grammar`` (the parsed
        grammar), whose ``compile_*`` / ``from_*`` functions take the same arguments."""
        reason = self.unsupported_reason(spec)
        if reason is not None:
            raise StructuredOutputError(reason, backend=NAME)
        parse_only = builder is not self._compiler

        def call(name: str, *args, **kwargs) -> Any:
            return getattr(builder, _PARSERS[name] if parse_only else "compile_" + name)(*args, **kwargs)
        try:
            return self._build_kind(spec, call)
        except StructuredOutputError:
            raise
        except Exception as e:  # RuntimeError, InvalidJSONError, InvalidStructuralTagError, KeyError, ...
            raise StructuredOutputError(f"Invalid {spec.kind.value} for xgrammar: {compiler_reason(e)}",
                                        backend=NAME) from None

    @staticmethod
    def _build_kind(spec: GrammarSpec, call) -> Any:
        kind = spec.kind
        # Without any whitespace, the JSON is compact (no space after ',' and ':'), as the guidance
        # backend writes it.
        separators = None if spec.any_whitespace else (",", ":")
        if kind is GrammarKind.JSON:
            # strict_mode: objects get only the properties the schema lists unless it allows more.
            return call("json_schema", spec.text, any_whitespace=spec.any_whitespace, separators=separators,
                        strict_mode=True)
        if kind is GrammarKind.JSON_OBJECT:
            return call("json_schema", '{"type": "object"}', any_whitespace=spec.any_whitespace,
                        separators=separators, strict_mode=False)
        if kind is GrammarKind.REGEX:
            return call("regex", spec.text)
        if kind is GrammarKind.CHOICE:
            return call("grammar", choice_ebnf(spec.value()))
        if kind is GrammarKind.GRAMMAR:
            return call("grammar", spec.text)
        if kind is GrammarKind.STRUCTURAL_TAG:
            return XgrammarBackend._build_structural_tag(spec, call)
        raise StructuredOutputError(f"xgrammar cannot compile a {kind.value} constraint.", backend=NAME)

    @staticmethod
    def _build_structural_tag(spec: GrammarSpec, call) -> Any:
        import xgrammar as xgr

        tag = spec.value()
        if "structures" not in tag:
            return call("structural_tag", spec.text)
        structures = tag["structures"]
        triggers = tag.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise StructuredOutputError("structural_tag needs a list 'structures' and a list 'triggers'.",
                                        backend=NAME)
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", True)),
                                       end=s["end"]) for s in structures]
        return call("structural_tag", items, triggers)


_PARSERS = {"json_schema": "from_json_schema", "regex": "from_regex", "grammar": "from_ebnf",
            "structural_tag": "from_structural_tag"}
"""``xgrammar.Grammar``'s parser of what each ``GrammarCompiler.compile_<kind>`` compiles."""


def choice_ebnf(choices: Sequence[str]) -> str:
    """A GBNF grammar whose language is exactly ``choices`` (JSON string escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
