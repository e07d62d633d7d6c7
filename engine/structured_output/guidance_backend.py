"""The guidance backend (llguidance): JSON schema, regex (Rust regex syntax), choice, Lark or GBNF
grammars and the ``structures``/``triggers`` form of structural tags. Compiling builds one
``llguidance.LLMatcher`` (the grammar's lexer and parser); each request's matcher is a deep copy of it."""

from __future__ import annotations

import copy
import json
from typing import Any, Optional, Sequence

import torch

from engine.structured_output.backend import fill_allow_all
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.spec import GrammarKind, GrammarSpec

NAME = "guidance"
"""The backend's name in ``--structured-outputs-backend`` and errors."""
_LOG_LEVEL = 0
"""llguidance's log level: silent (errors are read with ``get_error``)."""


class GuidanceMatcher:
    """``GrammarMatcher`` over an ``llguidance.LLMatcher``.

    llguidance enters a permanent error state on a token its grammar does not allow, so each token is
    validated before it is consumed. Once the grammar can only end (``is_stopped``), a stop token does
    not enter llguidance's token history: the matcher remembers it, so ``rollback`` counts it like
    xgrammar does.
    """

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int], vocab_size: int) -> None:
        self._matcher = matcher
        """The ``llguidance.LLMatcher``."""
        self._vocab_size = vocab_size
        """Ids at or past it are refused here (llguidance would enter its error state)."""
        self._stop_token_ids = stop_token_ids
        """The ids that end the output."""
        self._terminated = False
        """A stop token was accepted last."""
        self._stop_outside_history = False
        """That stop token is not in llguidance's history (it came after the grammar had stopped)."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        accepted = 0
        for token_id in token_ids:
            if not self._accept_one(int(token_id)):
                self.rollback(accepted)  # all or none
                return False
            accepted += 1
        return True

    def _accept_one(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._vocab_size:
            return False
        is_stop = token_id in self._stop_token_ids
        if is_stop and self._matcher.is_stopped():
            self._terminated = self._stop_outside_history = True
            return True
        try:
            if self._matcher.validate_tokens([token_id]) != 1 or not self._matcher.consume_token(token_id):
                return False
        except (ValueError, OverflowError, TypeError):
            return False
        self._terminated = is_stop
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._stop_outside_history:
            num_tokens -= 1
            self._stop_outside_history = False
        self._terminated = False
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated or self._matcher.is_error():
            fill_allow_all(bitmask, row)
            return
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._matcher.reset()
        self._terminated = self._stop_outside_history = False


class GuidanceGrammar:
    """A grammar llguidance has built: a pristine ``LLMatcher`` that ``new_matcher`` copies."""

    backend = NAME

    def __init__(self, spec: GrammarSpec, template: Any, stop_token_ids: frozenset[int],
                 vocab_size: int) -> None:
        self.spec = spec
        """What was compiled."""
        self._vocab_size = vocab_size
        """The width of the model's logits."""
        self._template = template
        """The ``llguidance.LLMatcher`` at the start of the grammar; never advanced."""
        self._stop_token_ids = stop_token_ids
        """The ids that end the output."""

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy(), self._stop_token_ids, self._vocab_size)


class GuidanceBackend:
    """llguidance bound to one tokenizer. ``compile`` is thread-safe (llguidance drops the GIL while it
    builds a grammar)."""

    name = NAME

    def __init__(self, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Optional[Sequence[int]] = None) -> None:
        """
        Args:
            tokenizer: a fast Hugging Face tokenizer.
            vocab_size: the width of the model's logits (ids past the tokenizer's are never allowed).
            stop_token_ids: the ids that end the output; None: the tokenizer's EOS.

        Raises:
            StructuredOutputError: llguidance cannot read this tokenizer (a slow tokenizer, ...).
        """
        import llguidance.hf

        self.vocab_size = int(vocab_size)
        try:
            eos = list(stop_token_ids) if stop_token_ids else None
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except Exception as e:  # ValueError for a slow tokenizer, others from the Rust side
            raise StructuredOutputError(f"The guidance backend cannot read this model's tokenizer: {e}",
                                        backend=NAME) from None
        self.stop_token_ids = frozenset(self._tokenizer.eos_tokens)
        """The ids the matcher accepts to end the output."""

    def unsupported_reason(self, spec: GrammarSpec) -> Optional[str]:
        if spec.kind is GrammarKind.STRUCTURAL_TAG and "structures" not in spec.value():
            return ("The guidance backend reads only the structural tag form with 'structures' and "
                    "'triggers'.")
        return None

    def compile(self, spec: GrammarSpec) -> GuidanceGrammar:
        import llguidance

        grammar = self._checked_grammar_text(spec)
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=_LOG_LEVEL)
        if template.is_error():
            raise StructuredOutputError(f"Invalid {spec.kind.value} for the guidance backend: "
                                        f"{template.get_error().strip()}", backend=NAME)
        return GuidanceGrammar(spec, template, self.stop_token_ids, self.vocab_size)

    def check(self, spec: GrammarSpec) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self._checked_grammar_text(spec))
        if error:
            raise StructuredOutputError(f"Invalid {spec.kind.value} for the guidance backend: {error.strip()}",
                                        backend=NAME)

    def _checked_grammar_text(self, spec: GrammarSpec) -> str:
        """``_grammar_text``, raising ``StructuredOutputError`` for what this backend does not read."""
        reason = self.unsupported_reason(spec)
        if reason is not None:
            raise StructuredOutputError(reason, backend=NAME)
        try:
            return self._grammar_text(spec)
        except StructuredOutputError:
            raise
        except (ValueError, KeyError, TypeError, AssertionError) as e:
            raise StructuredOutputError(f"Invalid {spec.kind.value} for the guidance backend: {e}",
                                        backend=NAME) from None

    def _grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar (its JSON form) of ``spec``."""
        import llguidance

        options = {"whitespace_flexible": spec.any_whitespace}
        kind = spec.kind
        if kind is GrammarKind.JSON:
            schema = spec.value()
            if not spec.additional_properties:
                schema = no_additional_properties(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if kind is GrammarKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind is GrammarKind.REGEX:
            return llguidance.grammar_from("regex", spec.text)
        if kind is GrammarKind.CHOICE:
            return llguidance.grammar_from("choice", spec.text)
        if kind is GrammarKind.GRAMMAR:
            return llguidance.grammar_from("grammar", spec.text)
        if kind is GrammarKind.STRUCTURAL_TAG:
            return self._structural_tag_grammar(spec.value())
        raise StructuredOutputError(f"The guidance backend cannot compile a {kind.value} constraint.",
                                    backend=NAME)

    @staticmethod
    def _structural_tag_grammar(tag: dict) -> str:
        import llguidance

        triggers = tag.get("triggers")
        structures = tag.get("structures")
        if not isinstance(triggers, list) or not isinstance(structures, list) or not structures:
            raise StructuredOutputError("structural_tag needs a non-empty list 'structures' and a list "
                                        "'triggers'.", backend=NAME)
        tags = []
        for s in structures:
            begin = s["begin"]
            trigger = next((t for t in triggers if isinstance(t, str) and begin.startswith(t)), None)
            if trigger is None:
                raise StructuredOutputError(f"structural_tag: the begin {begin!r} starts with none of the "
                                            f"triggers {triggers}.", backend=NAME)
            tags.append(llguidance.StructTag(trigger=trigger, begin=begin,
                                             grammar=json.dumps(s.get("schema", True)), end=s["end"]))
        return llguidance.StructTag.to_grammar(tags)


def no_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas without ``additionalProperties`` get it False."""
    schema = copy.deepcopy(schema)
    _close_objects(schema)
    return schema


def _close_objects(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    if ("properties" in node or node.get("type") == "object") and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # data, not schemas
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(value, dict):
                for sub in value.values():
                    _close_objects(sub)
        else:
            _close_objects(value)
