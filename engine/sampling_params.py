"""User-facing sampling parameters, as vLLM's ``SamplingParams``."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional, Union

from engine.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5

MAX_STOP_STRINGS = 256
"""Stop strings a request may carry (OpenAI allows 4): each one is matched against every sample's text
after every token."""
MAX_STOP_STRING_CHARS = 1024
"""Characters of one stop string: streaming holds back as many characters minus one."""
MAX_STOP_TOKEN_IDS = 1024
"""Stop token ids a request may carry."""

_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                 "min_p")
"""The float knobs: each must be a finite number."""
_REPR_ITEMS = 4
"""Items of a list field ``repr`` shows before a count of the rest."""
_REPR_CHARS = 64
"""Characters of a string ``repr`` shows before a count of the rest."""


def stop_bound_error(stop: Any, stop_token_ids: Any) -> Optional[tuple[str, str]]:
    """``(field, message)`` when ``stop`` (a string or a list) or ``stop_token_ids`` is past the bounds
    (``MAX_STOP_STRINGS``, ``MAX_STOP_STRING_CHARS``, ``MAX_STOP_TOKEN_IDS``); None within them. Items of
    other types are left to the type checks."""
    strings = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else []
    if len(strings) > MAX_STOP_STRINGS:
        return "stop", (f"stop has {len(strings)} strings; at most {MAX_STOP_STRINGS} are allowed.")
    for s in strings:
        if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS:
            return "stop", (f"stop has a string of {len(s)} characters; each may have at most "
                            f"{MAX_STOP_STRING_CHARS}.")
    if isinstance(stop_token_ids, (list, tuple)) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return "stop_token_ids", (f"stop_token_ids has {len(stop_token_ids)} ids; at most "
                                  f"{MAX_STOP_TOKEN_IDS} are allowed.")
    return None


def short_repr(value: Any) -> str:
    """``repr`` of a field value, bounded: lists show their first ``_REPR_ITEMS`` items and the count of
    the rest, strings their first ``_REPR_CHARS`` characters and the count of the rest."""
    if isinstance(value, str):
        if len(value) <= _REPR_CHARS:
            return repr(value)
        return f"{value[:_REPR_CHARS]!r}...<{len(value)} chars>"
    if isinstance(value, (list, tuple, set)):
        shown = ", ".join(short_repr(v) for v in itertools.islice(value, _REPR_ITEMS))
        if len(value) > _REPR_ITEMS:
            return f"[{shown}, ...<{len(value)} items>]"
        return f"[{shown}]"
    return repr(value)[:_REPR_CHARS * 2]


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    """Each RequestOutput carries everything generated so far."""
    DELTA = 1
    """Each RequestOutput carries only what is new since the last one (streaming)."""
    FINAL_ONLY = 2
    """One RequestOutput when the request finishes (offline ``LLM.generate``)."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Field names and defaults follow vLLM.

    Invalid values raise ``ValueError`` naming the field (``verify()`` runs at construction). ``repr`` is
    bounded (long lists and strings are summarized), so a request log line stays short.
    """

    n: int = 1
    """Independent samples per prompt; they share the prompt's KV blocks."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """HF semantics over prompt + output tokens: positive logits divided, negative multiplied."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set whose probability mass reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1: all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    seed: Optional[int] = None
    """Per-request generator: same seed, same tokens, whatever else is in the batch."""
    stop: Optional[Union[str, list[str]]] = None
    """Strings that end generation; never returned, not even partly."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end generation (the token is kept in token_ids, not in text)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    max_tokens: Optional[int] = 16
    """New tokens at most; None: up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens exist."""
    logprobs: Optional[int] = None
    """Top-N logprobs per generated token (+ the sampled token's)."""
    prompt_logprobs: Optional[int] = None
    """Top-N logprobs per prompt token (the first is None)."""
    skip_special_tokens: bool = True
    """Drop special tokens from the detokenized text."""
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logits_processors: Optional[list] = None
    """Unsupported; present so vLLM code that passes None works."""
    structured_outputs: Optional[StructuredOutputsParams] = None
    """Constrain the output to a JSON schema, regex, choice, grammar or structural tag (a dict is read
    with ``StructuredOutputsParams.from_dict``)."""
    # Derived: the longest stop string minus one, the text held back while streaming.
    _output_text_buffer_length: int = field(default=0, repr=False)
    # Derived: eos ids added by the engine (generation_config), set at request admission.
    _all_stop_token_ids: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.temperature is not None and self.temperature < _SAMPLING_EPS and self.temperature >= 0:
            # Greedy: make the other knobs neutral so the sampler takes the argmax path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.verify()
        if self.stop and not self.include_stop_str_in_output:
            self._output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._all_stop_token_ids = set(self.stop_token_ids)

    def verify(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                bad(name, f"must be a finite number, got {value}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature is None or self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0, -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2 ** 63 <= self.seed < 2 ** 63):
            bad("seed", f"must be a 64-bit integer (-2**63 .. 2**63-1), got {self.seed!r}.")
        bound = stop_bound_error(self.stop, self.stop_token_ids)
        if bound is not None:
            raise ValueError(bound[1])
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "must contain only non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must contain only non-negative integers.")
        if self.logits_processors:
            bad("logits_processors", "are not supported by Chorus.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            bad("structured_outputs", f"must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}.")

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={short_repr(getattr(self, f.name))}" for f in fields(self) if f.repr)
        return f"SamplingParams({shown})"

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        import copy
        return copy.deepcopy(self)
