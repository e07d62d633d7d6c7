"""Grammar compilation off the engine loop: a small thread pool with a cache of compiled grammars.

The cache is keyed by a hash of (backend, spec kind, canonical spec text and options, tokenizer
identity) and holds the ``Future`` of each compilation, so requests with the same spec share one
compilation, finished or in flight. A spec that does not compile is cached too: its future raises the
same ``StructuredOutputError`` (the compiler's reason) for every request that carries it.

Request processing calls ``validate`` so a bad spec is a 400 before the request reaches the engine; the
engine's ``submit`` of the same spec in the same process is then a cache hit on the finished grammar. When
the engine runs in a process of its own, the API process holds a copy of the pool that only checks specs
(``check_only``: the backend parses a spec without compiling it against the tokenizer), so each spec is
compiled once, in the engine process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, Union

from engine.structured_output.backend import CompiledGrammar, StructuredOutputBackend
from engine.structured_output.errors import PARAM_STRUCTURED_OUTPUTS, StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.selection import UnavailableBackend, make_backend
from engine.structured_output.spec import GrammarSpec

logger = logging.getLogger("chorus.structured_output")

DEFAULT_MAX_WORKERS = 2
"""Compile threads: compilations are rare next to decode steps, and each may use a few threads of its
own inside the library."""
DEFAULT_MAX_CACHED = 512
"""Compiled grammars (and failures) the cache keeps, least recently used dropped first."""

SpecLike = Union[GrammarSpec, StructuredOutputsParams]


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int,
                          stop_token_ids: Optional[Sequence[int]] = None) -> str:
    """A hex digest of what a compiled grammar depends on in the tokenizer: its vocabulary (token
    strings and ids), its special tokens, the logits width and the stop ids."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode("utf-8"))
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    h.update(json.dumps([special, int(vocab_size), sorted(stop_token_ids or [])]).encode("utf-8"))
    return h.hexdigest()


class GrammarCompilePool:
    """Compiles specs on a thread pool, once per distinct spec (``submit``), for one backend and
    tokenizer. Thread-safe."""

    def __init__(self, backend: StructuredOutputBackend, tokenizer_id: str,
                 max_workers: int = DEFAULT_MAX_WORKERS, max_cached: int = DEFAULT_MAX_CACHED,
                 check_only: bool = False) -> None:
        """
        Args:
            backend: compiles the specs (``selection.make_backend``).
            tokenizer_id: the tokenizer's identity in cache keys (``tokenizer_fingerprint``).
            max_workers: compile threads.
            max_cached: compiled grammars (and failures) kept.
            check_only: ``validate`` parses specs without compiling them (``StructuredOutputBackend.check``):
                the pool of a process that validates requests for an engine in another process.
        """
        self.check_only = check_only
        """``validate`` checks specs and compiles none."""
        self.backend = backend
        """What compiles."""
        self.vocab_size = backend.vocab_size
        """The width of the model's logits (the bitmask's ``vocab_size``)."""
        self._tokenizer_id = tokenizer_id
        self._max_cached = max_cached
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self.cache_hits = 0
        """``submit`` calls answered from the cache (finished or in flight)."""
        self.cache_misses = 0
        """``submit`` calls that started a compilation."""
        self._rebuild_args: Optional[tuple] = None
        """``for_tokenizer``'s arguments, when it built the pool (what it pickles as)."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, backend: str = "auto",
                      stop_token_ids: Optional[Sequence[int]] = None,
                      max_workers: int = DEFAULT_MAX_WORKERS,
                      max_cached: int = DEFAULT_MAX_CACHED, check_only: bool = False) -> "GrammarCompilePool":
        """A pool for ``tokenizer`` with the backend named ``backend`` (``auto``, ``xgrammar``,
        ``guidance``). A named backend that cannot read the tokenizer is logged, and every spec then fails
        with its reason (``selection.UnavailableBackend``). The pool pickles as these arguments with
        ``check_only`` set (the engine process sends its request processor, which validates with a pool, to
        the API process, which then checks specs and leaves their compilation to the engine)."""
        try:
            built = make_backend(backend, tokenizer, vocab_size, stop_token_ids)
        except StructuredOutputError as e:
            logger.warning("Constrained decoding is unavailable (--structured-outputs-backend %s): %s",
                           backend, e)
            built = UnavailableBackend(backend, vocab_size, e)
        fingerprint = tokenizer_fingerprint(tokenizer, vocab_size, stop_token_ids)
        pool = cls(built, fingerprint, max_workers, max_cached, check_only)
        pool._rebuild_args = (tokenizer, vocab_size, backend, list(stop_token_ids or []), max_workers,
                              max_cached, True)
        return pool

    def __reduce__(self) -> tuple:
        """A pool built by ``for_tokenizer`` pickles as its arguments (a fresh pool, empty cache) with
        ``check_only`` set."""
        if self._rebuild_args is None:
            raise TypeError("only a GrammarCompilePool built by for_tokenizer can be pickled")
        return (GrammarCompilePool.for_tokenizer, self._rebuild_args)

    def cache_key(self, spec: GrammarSpec) -> str:
        """The cache key of ``spec``: a hash of the backend, the spec and the tokenizer."""
        h = hashlib.sha256()
        for part in (self.backend.name, spec.key(), self._tokenizer_id):
            h.update(part.encode("utf-8"))
            h.update(b"\x00")
        return h.hexdigest()

    def submit(self, spec: SpecLike) -> "Future[CompiledGrammar]":
        """The future of ``spec``'s compiled grammar; it raises ``StructuredOutputError`` when the spec
        does not compile. Never blocks on a compilation."""
        spec = as_spec(spec)
        return self._submit(spec, self.backend.compile, self.cache_key(spec))

    def _submit(self, spec: GrammarSpec, run: Callable[[GrammarSpec], Any], key: str) -> Future:
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return future
            self.cache_misses += 1
            future = self._executor.submit(run, spec)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f, key=key: self._forget_unexpected_failure(key, f))
        return future

    def _forget_unexpected_failure(self, key: str, future: Future) -> None:
        """Drop a compilation that failed with anything but ``StructuredOutputError`` (not a property of
        the spec), so the next request compiles it again."""
        if future.cancelled() or not isinstance(future.exception(), (StructuredOutputError, type(None))):
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def validate(self, spec: SpecLike, param: str = PARAM_STRUCTURED_OUTPUTS,
                 timeout_s: Optional[float] = None) -> None:
        """Compile ``spec`` (or find it in the cache; with ``check_only``, parse it) and wait for it: for
        request processing, so a bad spec is rejected before the engine. Blocks the calling thread.

        Raises:
            StructuredOutputError: the spec does not compile; ``param`` names the request field.
            concurrent.futures.TimeoutError: not compiled within ``timeout_s``.
        """
        spec = as_spec(spec)
        future = (self._submit(spec, self.backend.check, self.cache_key(spec) + ":checked") if self.check_only
                  else self.submit(spec))
        try:
            future.result(timeout=timeout_s)
        except StructuredOutputError as e:
            raise e.with_param(param) from None

    def cache_size(self) -> int:
        """Compiled grammars (and failures, and compilations in flight) in the cache."""
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        """Stop the compile threads; compilations not started are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def as_spec(spec: SpecLike) -> GrammarSpec:
    """``spec`` as a ``GrammarSpec``."""
    return spec if isinstance(spec, GrammarSpec) else GrammarSpec.from_params(spec)
