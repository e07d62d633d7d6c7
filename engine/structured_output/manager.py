"""``StructuredOutputManager``: the scheduler side of constrained decoding. It owns each constrained
request's compile future and matcher, says which requests may be scheduled, feeds the matchers the
sampled tokens and fills the host bitmask of a step's sampling rows.

Call points (one manager per engine, used from the engine loop's thread only):

1. **add_request** (request admitted; each of the ``n`` samples is its own request):
   ``manager.add_request(req_id, sampling_params.structured_outputs)`` submits the compilation to the
   pool (a cache hit when request processing already ran ``GrammarCompilePool.validate``).
2. **schedule**: a constrained request is schedulable once ``manager.poll(req_id)`` is ``READY``; while
   ``COMPILING`` the scheduler skips it and schedules the others (it holds no slot, no KV blocks, and
   nothing waits on it). ``FAILED``: finish the request with ``manager.error(req_id)`` (a 400 when it
   reaches a client; the server's ``validate`` normally catches it first).
3. **before sampling** (after the forward is launched, so this host work overlaps the GPU):
   ``grammar = manager.fill_bitmask([(req_id, logits_row), ...])`` for the requests that sample this
   step (decodes and final prefill chunks; a partial prefill chunk samples nothing and has no row).
   None: no row is constrained. Otherwise the runner copies ``grammar.bitmask`` to the device
   (``non_blocking``, it is pinned) and the sampler calls
   ``bitmask.apply_token_bitmask(logits, device_bitmask, grammar.row_indices)`` on the processed logits
   (after penalties / temperature, before top-k/top-p and the draw). Rows whose grammar allows only the
   stop tokens must not have those masked by ``min_tokens`` (the row would be all -inf).
4. **update_from_output** (the step's sampled tokens are on the host):
   ``manager.accept_tokens(req_id, new_token_ids)`` for each constrained request. ``TERMINATED``: the
   grammar ended with a stop token; finish the request with finish_reason ``stop`` (the normal EOS check
   usually does already). ``REJECTED``: the sampler produced a token the grammar forbids (the matcher is
   unchanged); finish the request with an error.
5. **finish / abort**: ``manager.free(req_id)``. **preempt**: a request that keeps its output tokens
   (recompute) keeps its matcher as it is; when the engine drops output tokens the matcher had
   accepted (a discarded speculative or in-flight step), ``manager.rollback_to(req_id, kept_tokens)``.

Async scheduling: the bitmask of step N+1 depends on the token of step N, which the scheduler only has
as a placeholder when it schedules N+1. The rule is simple and correct: a step that samples a
constrained request resolves the previous step's output first. The engine launches the forward of
N+1, waits for step N's sampled tokens (they precede N+1 on the stream), runs update_from_output of
step N (which calls ``accept_tokens``), then ``fill_bitmask`` for N+1 while the GPU still runs the
forward of N+1; steps without constrained requests keep the usual deferred order.
``num_accepted_tokens(req_id)`` against the request's output length (placeholders included) tells
whether a request's matcher is behind.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

import torch

from engine.structured_output.backend import CompiledGrammar, GrammarMatcher
from engine.structured_output.bitmask import allocate_bitmask
from engine.structured_output.compiler import GrammarCompilePool
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams


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

    def add_request(self, req_id: str, params: StructuredOutputsParams) -> None:
        """Start tracking ``req_id`` and submit its grammar (cached by spec)."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already has a grammar")
        self._requests[req_id] = _RequestGrammar(future=self.compile_pool.submit(params))

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
        """Feed ``req_id``'s matcher the tokens it just sampled (all or none of them)."""
        entry, matcher = self._matcher(req_id)
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
        return entry.num_accepted_tokens + entry.num_tokens_after_end

    def is_terminated(self, req_id: str) -> bool:
        """``req_id``'s grammar has ended with a stop token."""
        entry = self._requests.get(req_id)
        return entry is not None and entry.matcher is not None and entry.matcher.is_terminated()

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` output tokens of ``req_id``."""
        if num_tokens < 0 or num_tokens > self.num_accepted_tokens(req_id):
            raise ValueError(f"cannot roll back {num_tokens} tokens of request {req_id!r}: it has "
                             f"{self.num_accepted_tokens(req_id)}")
        entry, matcher = self._matcher(req_id)
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
            _, matcher = self._matcher(req_id)
            matcher.fill_bitmask(self._bitmask, row)
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
