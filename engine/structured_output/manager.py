"""``StructuredOutputManager``: the scheduler side of constrained decoding. It owns each constrained
request's compile future and matcher, says which requests may be scheduled, feeds the matchers the
sampled tokens and fills the host bitmask of a step's sampling rows.

Call points (one manager per engine, held by the ``Scheduler``, used from the engine loop's thread only):

1. **add_request** (``Scheduler.add_request``; each of the ``n`` samples is its own request):
   ``manager.add_request(req_id, sampling_params.structured_outputs, reasoning=tracker)`` submits the
   compilation to the pool (a cache hit when request processing already ran ``GrammarCompilePool.validate``).
   ``reasoning``: with a reasoning parser, the reply's ``ReasoningTracker``: its reasoning is unconstrained
   and the grammar starts after it.
2. **schedule**: a waiting constrained request is schedulable once ``manager.is_ready(req_id)``; while it
   compiles the scheduler skips it and schedules the others (it holds no slot, no KV blocks, and nothing
   waits on it; an engine with nothing else to run sleeps in ``wait_for_compilation``). ``error(req_id)``
   set: the request ends with it (a 400 when it reaches a client; request processing normally catches it
   first).
3. **before sampling** (``ModelRunner`` asks the engine core once the forward is launched, so this host
   work overlaps the device: ``engine.runner.grammar_mask``):
   ``grammar = manager.fill_bitmask([(req_id, logits_row), ...])`` for the requests that sample this
   step (decodes and final prefill chunks; a partial prefill chunk samples nothing and has no row).
   None: no row is constrained. Otherwise the runner copies ``grammar.bitmask`` to the device
   (``non_blocking``, it is pinned) and the sampler applies it (``engine.sampler``) to a copy of the
   logits, after the raw logprobs are taken and before min_tokens, penalties, temperature and the
   filters; a row whose grammar allows only stop tokens keeps them under ``min_tokens``.
4. **update_from_output** (the step's sampled tokens are on the host):
   ``manager.accept_tokens(req_id, new_token_ids)`` for each constrained request. ``TERMINATED``: the
   grammar ended with a stop token; the request finishes with finish_reason ``stop`` (the normal EOS check
   usually does already). ``REJECTED``: the sampler produced a token the grammar forbids (the matcher is
   unchanged); the request ends with an error.
5. **finish / abort**: ``manager.free(req_id)``. **preempt**: a request that keeps its output tokens
   (recompute, this engine's preemption) keeps its matcher as it is; an engine that drops output tokens the
   matcher had accepted (a discarded speculative step) calls ``manager.rollback_to(req_id, kept_tokens)``.

Async scheduling: the bitmask of step N+1 depends on the token of step N, which the scheduler only has
as a placeholder when it schedules N+1. The rule is simple and correct: a step that samples a
constrained request resolves the previous step's output first. The engine launches the forward of
N+1, waits for step N's sampled tokens (they precede N+1 on the stream), runs update_from_output of
step N (which calls ``accept_tokens``), then ``fill_bitmask`` for N+1 while the device still runs the
forward of N+1; steps without constrained requests keep the usual deferred order. A placeholder token is
never accepted: only ``update_from_output`` feeds the matchers.
``num_accepted_tokens(req_id)`` against the request's output length (placeholders included) tells
whether a request's matcher is behind.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Protocol, Sequence

import torch

from engine.reasoning.parser import ReasoningState, ThinkTagIds
from engine.structured_output.backend import CompiledGrammar, GrammarMatcher, fill_allow_all
from engine.structured_output.bitmask import BITS_PER_WORD, allocate_bitmask
from engine.structured_output.compiler import GrammarCompilePool
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams


class ReasoningTracker(Protocol):
    """Where a request's reply is in its reasoning, over token ids
    (``engine.reasoning.think_tags.ReasoningTokenTracker``): the constraint applies once reasoning ended."""

    state: ReasoningState
    """BEFORE (the first token decides whether the reply reasons), IN, or AFTER (reasoning is over)."""
    tag_ids: ThinkTagIds
    """The think tags' ids (the opening one is allowed besides the grammar's tokens in BEFORE)."""

    @property
    def reasoning_ended(self) -> bool:
        """Reasoning is over (or never happens)."""
        ...

    def feed(self, token_ids: Sequence[int]) -> bool:
        """Advance over sampled ids; returns ``reasoning_ended``."""
        ...


class GrammarStatus(Enum):
    """Where a request's grammar is."""

    COMPILING = "compiling"
    """Not compiled yet: do not schedule the request."""
    READY = "ready"
    """Compiled; the request has its matcher."""
    FAILED = "failed"
    """Did not compile: finish the request with ``error``."""


class AcceptStatus(Enum):
    """What ``accept_tokens`` did."""

    ACCEPTED = "accepted"
    """The grammar allowed the tokens; it has not ended."""
    TERMINATED = "terminated"
    """The grammar allowed the tokens and ended with a stop token: finish the request (``stop``)."""
    REJECTED = "rejected"
    """The grammar forbids a token; nothing was accepted."""


@dataclass
class GrammarBitmask:
    """The filled bitmask of one step."""

    bitmask: torch.Tensor
    """``[max(row_indices) + 1, words]`` int32 view of the manager's pinned host buffer; row ``r``
    constrains logits row ``r``. The next ``fill_bitmask`` overwrites it: its copy to the device must be
    done by then (it is once the step's sampled tokens were read, which the next fill waits for)."""
    row_indices: list[int]
    """The logits rows that are constrained (the others are left alone)."""


@dataclass
class _RequestGrammar:
    """One constrained request."""

    future: "Future[CompiledGrammar]"
    """The compilation (shared with every request of the same spec)."""
    matcher: Optional[GrammarMatcher] = None
    """Set when the compilation is done."""
    error: Optional[StructuredOutputError] = None
    """Set when it failed."""
    num_accepted_tokens: int = 0
    """Output tokens the matcher has accepted (a stop token included)."""
    num_tokens_after_end: int = 0
    """Output tokens reported after the grammar terminated (not fed to the matcher)."""
    reasoning: Optional[ReasoningTracker] = None
    """The reply's reasoning (a reasoning parser is configured): the grammar constrains only what follows
    it. None: the grammar constrains the whole output."""
    num_reasoning_tokens: int = 0
    """Output tokens of the reasoning (the closing tag included; not fed to the matcher)."""


class StructuredOutputManager:
    """Per-request matchers and the host bitmask of one engine (see the module docstring)."""

    def __init__(self, compile_pool: GrammarCompilePool, max_num_seqs: int) -> None:
        """
        Args:
            compile_pool: compiles (and caches) the grammars.
            max_num_seqs: the most rows a step samples: the bitmask's height.
        """
        self.compile_pool = compile_pool
        self._requests: dict[str, _RequestGrammar] = {}
        self._bitmask = allocate_bitmask(max_num_seqs, compile_pool.vocab_size)  # [max_num_seqs, words]

    def add_request(self, req_id: str, params: StructuredOutputsParams,
                    reasoning: Optional[ReasoningTracker] = None) -> None:
        """Start tracking ``req_id`` and submit its grammar (cached by spec). ``reasoning``: the reply
        reasons first (an engine with a reasoning parser); its tokens are unconstrained until the tracker
        says reasoning ended (in BEFORE, the opening tag is allowed besides the grammar's first tokens)."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already has a grammar")
        self._requests[req_id] = _RequestGrammar(future=self.compile_pool.submit(params), reasoning=reasoning)

    def is_constrained(self, req_id: str) -> bool:
        """Whether ``req_id`` has a grammar here."""
        return req_id in self._requests

    def poll(self, req_id: str) -> GrammarStatus:
        """The grammar's status; builds the request's matcher when the compilation has finished."""
        entry = self._requests[req_id]
        if entry.matcher is not None:
            return GrammarStatus.READY
        if entry.error is not None:
            return GrammarStatus.FAILED
        if not entry.future.done():
            return GrammarStatus.COMPILING
        try:
            entry.matcher = entry.future.result().new_matcher()
        except StructuredOutputError as e:
            entry.error = e
            return GrammarStatus.FAILED
        except Exception as e:  # a bug or resource error in a backend: the request fails, not the engine
            entry.error = StructuredOutputError(f"The grammar could not be compiled: {type(e).__name__}: {e}")
            return GrammarStatus.FAILED
        return GrammarStatus.READY

    def is_ready(self, req_id: str) -> bool:
        """True when ``req_id`` may be scheduled: unconstrained, or its matcher is ready."""
        return req_id not in self._requests or self.poll(req_id) is GrammarStatus.READY

    def wait_for_compilation(self, timeout_s: float) -> None:
        """Wait until a compilation in flight finishes, at most ``timeout_s`` (at once when none is): for an
        engine loop with nothing else to run."""
        compiling = [e.future for e in self._requests.values()
                     if e.matcher is None and e.error is None and not e.future.done()]
        if compiling:
            wait(compiling, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def error(self, req_id: str) -> Optional[StructuredOutputError]:
        """Why ``req_id``'s grammar failed (None unless ``poll`` said ``FAILED``)."""
        entry = self._requests.get(req_id)
        return entry.error if entry is not None else None

    def _matcher(self, req_id: str) -> tuple[_RequestGrammar, GrammarMatcher]:
        entry = self._requests[req_id]
        if entry.matcher is None and self.poll(req_id) is not GrammarStatus.READY:
            raise RuntimeError(f"request {req_id!r} has no ready grammar (it must not be scheduled)")
        return entry, entry.matcher

    def accept_tokens(self, req_id: str, token_ids: Sequence[int]) -> AcceptStatus:
        """Feed ``req_id``'s matcher the tokens it just sampled (all or none of them; reasoning tokens
        before them are taken even when those are rejected, which ends the request)."""
        entry, matcher = self._matcher(req_id)
        if entry.reasoning is not None and not entry.reasoning.reasoning_ended:
            num_reasoning = _reasoning_prefix(entry.reasoning, token_ids)
            entry.num_reasoning_tokens += num_reasoning
            token_ids = token_ids[num_reasoning:]
            if not token_ids:
                return AcceptStatus.ACCEPTED
        if matcher.is_terminated():
            entry.num_tokens_after_end += len(token_ids)
            return AcceptStatus.TERMINATED
        if not matcher.accept_tokens(token_ids):
            return AcceptStatus.REJECTED
        entry.num_accepted_tokens += len(token_ids)
        return AcceptStatus.TERMINATED if matcher.is_terminated() else AcceptStatus.ACCEPTED

    def num_accepted_tokens(self, req_id: str) -> int:
        """Output tokens ``req_id``'s matcher has taken in (tokens reported after its end included)."""
        entry = self._requests[req_id]
        return entry.num_reasoning_tokens + entry.num_accepted_tokens + entry.num_tokens_after_end

    def is_terminated(self, req_id: str) -> bool:
        """``req_id``'s grammar has ended with a stop token."""
        entry = self._requests.get(req_id)
        return entry is not None and entry.matcher is not None and entry.matcher.is_terminated()

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` output tokens of ``req_id`` (not into its reasoning: the
        tracker only moves forward)."""
        entry, matcher = self._matcher(req_id)
        if num_tokens < 0 or num_tokens > entry.num_accepted_tokens + entry.num_tokens_after_end:
            raise ValueError(f"cannot roll back {num_tokens} tokens of request {req_id!r}: it has "
                             f"{entry.num_accepted_tokens + entry.num_tokens_after_end} after its reasoning")
        past_end = min(num_tokens, entry.num_tokens_after_end)
        entry.num_tokens_after_end -= past_end
        num_tokens -= past_end
        if num_tokens:
            matcher.rollback(num_tokens)
            entry.num_accepted_tokens -= num_tokens

    def rollback_to(self, req_id: str, num_output_tokens: int) -> None:
        """Roll ``req_id``'s matcher back to having taken exactly its first ``num_output_tokens`` output
        tokens (no-op when it has taken no more)."""
        excess = self.num_accepted_tokens(req_id) - num_output_tokens
        if excess > 0:
            self.rollback(req_id, excess)

    def fill_bitmask(self, rows: Sequence[tuple[str, int]]) -> Optional[GrammarBitmask]:
        """Fill the bitmask rows of a step's sampling requests: ``rows`` is ``(req_id, logits_row)``
        for the requests that sample (unconstrained ones may be listed; they are skipped). None when
        no row is constrained."""
        filled: list[int] = []
        for req_id, row in rows:
            entry = self._requests.get(req_id)
            if entry is None:
                continue
            entry, matcher = self._matcher(req_id)
            reasoning = entry.reasoning
            if reasoning is not None and reasoning.state is ReasoningState.IN:
                fill_allow_all(self._bitmask, row)
            else:
                matcher.fill_bitmask(self._bitmask, row)
                if reasoning is not None and reasoning.state is ReasoningState.BEFORE:
                    _allow(self._bitmask, row, reasoning.tag_ids.start)
            filled.append(row)
        if not filled:
            return None
        return GrammarBitmask(bitmask=self._bitmask[:max(filled) + 1], row_indices=filled)

    def free(self, req_id: str) -> None:
        """Forget ``req_id`` (finished, aborted); the compiled grammar stays in the pool's cache."""
        self._requests.pop(req_id, None)

    def num_requests(self) -> int:
        """Constrained requests tracked."""
        return len(self._requests)


def _reasoning_prefix(reasoning: ReasoningTracker, token_ids: Sequence[int]) -> int:
    """Feed ``reasoning`` the leading ``token_ids`` that belong to the reasoning; returns how many do. In
    BEFORE, a first token other than the opening tag ends reasoning and is content itself."""
    for i, token_id in enumerate(token_ids):
        if reasoning.reasoning_ended:
            return i
        before = reasoning.state
        reasoning.feed([token_id])
        if before is ReasoningState.BEFORE and reasoning.reasoning_ended:
            return i
    return len(token_ids)


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token ``token_id``'s bit in ``bitmask[row]`` (``[rows, words]`` int32)."""
    bit = 1 << (token_id % BITS_PER_WORD)
    if bit >= 1 << 31:
        bit -= 1 << 32   # the sign bit of an int32 word
    bitmask[row, token_id // BITS_PER_WORD] |= bit
