"""How many sequences may wait and how long a request may live (``chorus serve --max-queued-requests``,
``--request-timeout``), and the errors a request gets when it runs into them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class EngineOverloadedError(RuntimeError):
    """More requests are in flight than ``RequestLimits`` allows; nothing was sent (HTTP 503 with
    Retry-After: the client should retry later)."""


class RequestTimeoutError(TimeoutError):
    """The request ran past ``RequestLimits.request_timeout_s``: it was aborted in the engine (its KV blocks
    are free) and its stream ends with this error (HTTP 504; streams: an in-band error event)."""


@dataclass
class RequestLimits:
    """How many requests may wait and how long one may live (``chorus serve --max-queued-requests``,
    ``--request-timeout``). The defaults limit nothing (offline use and tests)."""

    max_queued_requests: Optional[int] = None
    """Sequences in flight beyond the engine's ``max_num_seqs`` (those cannot all be running: they wait).
    A request counts ``n`` sequences (a completion with several prompts: prompts x n, reserved at once by
    ``AsyncLLM.reserve_sequences``) from its arrival, before it is tokenized or its media fetched, until its
    stream closes; one that does not fit now is refused with ``EngineOverloadedError``, one that could never
    fit (more than ``max_num_seqs + max_queued_requests``) with ``ValueError``. None: no limit."""
    request_timeout_s: Optional[float] = None
    """Seconds from a request's arrival after which it is aborted (``RequestTimeoutError``). None: never."""
