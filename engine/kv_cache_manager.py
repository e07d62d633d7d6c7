"""Per-request KV block lists on top of the block pool, with prefix caching.

A request's ``block_hashes`` cover every FULL block of ``all_token_ids`` (prompt and generated
tokens), chained, with extra keys so that KV computed under a different adapter, different
media or a different cache salt never matches:

- the adapter's ``(lora_name, lora_int_id)`` on every block of a LoRA request: the id changes
  when an adapter is unloaded and another is loaded under the same name, so stale KV never hits;
- ``(identifier, offset of the item relative to the block start)`` for each media item whose
  placeholder range overlaps the block;
- ``cache_salt`` on the first block only (the chain carries it to every later block).

Sliding windows (``sliding_window``: set when every layer of the model attends within that window,
``engine.models.sliding_window.kv_free_window``): the chunk starting at position p reads keys from
p - window + 1 on, so each allocation first returns the request's blocks entirely before that key to the
pool; their places in the request's list (and in the runner's block table, which is never read there)
take the null block. A returned block keeps its hash like any freed block: its KV is that of its prefix,
so a later request may still hit it. A hit needs only the blocks of the window before its end cached, not
the earlier ones (they stand as the null block: no query of the request reads them). The scheduler counts
what a request still needs: the blocks of its window and of its next chunk.
"""

from __future__ import annotations

from typing import Any, Optional

from engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from engine.request import Request


def window_start(position: int, window: Optional[int]) -> int:
    """The first key position the query at ``position`` reads under a sliding ``window`` (None: 0)."""
    return 0 if window is None else max(0, position - window + 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_extra_keys(request: Request, start_token_idx: int, end_token_idx: int) -> Optional[tuple[Any, ...]]:
    """Extra hash keys of the block covering tokens [start_token_idx, end_token_idx)."""
    keys: list[Any] = []
    if request.lora_request is not None:
        keys.append(("lora", request.lora_request.lora_name, request.lora_request.lora_int_id))
    for feature in request.mm_features:
        if feature.placeholder is None:
            if start_token_idx == 0:        # cross-attention input: every block depends on it (the chain)
                keys.append((feature.identifier, "cross"))
            continue
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset < end_token_idx and offset + length > start_token_idx:
            keys.append((feature.identifier, offset - start_token_idx))
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None


class KVCacheManager:
    """Which KV blocks each request holds, and prefix-cache lookups.

    Args:
        block_size: tokens per block.
        num_blocks: blocks in the cache, including the reserved null block 0.
        max_model_len: prompt + output tokens per request at most.
        enable_caching: reuse full blocks across requests by hash.
        sliding_window: positions every layer attends within; blocks before a request's window are
            returned to the pool while it runs (None: every block is kept).
        max_chunk_tokens: the most tokens one step computes for a request (the scheduler's token
            budget): with a window, it bounds the blocks a request holds at once.
    """

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 enable_caching: bool = True, sliding_window: Optional[int] = None,
                 max_chunk_tokens: Optional[int] = None) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.max_chunk_tokens = max_chunk_tokens
        # req_id -> how many of its leading blocks are out of its window (returned, the null block in place).
        self.num_dead_blocks: dict[str, int] = {}
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # req_id -> its blocks, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # req_id -> blocks holding its cross-attention K/V (encoder-decoder models), taken with its
        # first allocation, never prefix-cached, freed with its other blocks.
        self.req_to_cross_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix-cache counters, in tokens, since start.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- hashing ------------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            start = i * bs
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, tuple(tokens[start:start + bs]),
                                            block_extra_keys(request, start, start + bs)))

    # --- lookup and allocation ----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request.

        The hit is capped at ``num_tokens - 1`` tokens so the last token is always recomputed
        (its logits are needed). Requests asking for prompt logprobs skip the lookup.

        Returns:
            (blocks, num_computed_tokens): the hit blocks (not yet referenced; pass them to
            ``allocate_slots``) and the tokens they cover.
        """
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or request.num_cross_tokens):
            # NOTE: an encoder-decoder request recomputes from token 0 (its cross K/V are written there).
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_hit_blocks]
        if self.sliding_window is not None:
            blocks = self._window_hits(hashes)
        else:
            blocks = []
            for block_hash in hashes:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:
                    break
                blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def _window_hits(self, hashes: list[int]) -> list[KVCacheBlock]:
        """The longest prefix of ``hashes`` whose last window is cached: k blocks such that the blocks holding
        the keys the query at position k * block_size reads (from its window's start) are all in the cache;
        the earlier ones need not be (their KV is never read again), and stand as the null block."""
        bs = self.block_size
        found: list[Optional[KVCacheBlock]] = []
        run = best = 0              # cached blocks ending at the current one; the longest valid hit
        for i, block_hash in enumerate(hashes):
            block = self.block_pool.get_cached_block(block_hash)
            found.append(block)
            run = run + 1 if block is not None else 0
            first_needed = window_start((i + 1) * bs, self.sliding_window) // bs
            if run >= i + 1 - first_needed:
                best = i + 1
        first_needed = window_start(best * bs, self.sliding_window) // bs
        return [found[i] if i >= first_needed else self.block_pool.null_block for i in range(best)]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None,
                       num_new_computed_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> Optional[list[int]]:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Args:
            request: the request; its ``num_computed_tokens`` is the KV already held.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: prefix-hit blocks from ``get_computed_blocks`` (first
                allocation only).
            num_new_computed_tokens: tokens those blocks cover.
            full_sequence_must_fit: admission gate: also require free blocks for all of the
                request's current tokens, not just this chunk (avoids admitting a long prompt
                that would only thrash).

        Returns:
            Ids of the blocks newly allocated (excluding prefix hits), or None when the pool
            does not have enough free blocks; on None nothing changed (but blocks out of the
            request's window, which are returned either way).
        """
        new_computed_blocks = new_computed_blocks or []
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = min(num_computed + num_new_tokens, self.max_model_len)
        num_held = len(req_blocks) + len(new_computed_blocks)
        num_new_blocks = max(0, cdiv(num_tokens_after, self.block_size) - num_held)
        # With a window: blocks before the chunk's first key are never read again. The request's own go
        # back to the pool now (whether or not this allocation succeeds), prefix hits there are not taken.
        num_dead = window_start(num_computed, self.sliding_window) // self.block_size
        self._free_dead_blocks(req_id, req_blocks, num_dead)
        new_computed_blocks = [self.block_pool.null_block if len(req_blocks) + i < num_dead else b
                               for i, b in enumerate(new_computed_blocks)]
        # Prefix hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        num_cross_blocks = 0
        if request.num_cross_tokens and req_id not in self.req_to_cross_blocks:
            num_cross_blocks = cdiv(request.num_cross_tokens, self.block_size)
        num_needed = num_new_blocks + num_evictable_hits + num_cross_blocks
        if full_sequence_must_fit:
            num_live = num_held - min(num_dead, num_held)
            peak = self._peak_blocks(request.num_tokens, num_new_tokens)
            num_full_seq_blocks = max(0, peak - num_live)
            num_needed = max(num_needed, num_full_seq_blocks + num_evictable_hits + num_cross_blocks)
        if num_needed > self.block_pool.num_free_blocks:
            return None

        if new_computed_blocks:
            assert not req_blocks, "prefix hits are only taken on the first allocation"
            self.block_pool.touch(b for b in new_computed_blocks if not b.is_null)
        req_blocks = self.req_to_blocks.setdefault(req_id, req_blocks)
        req_blocks.extend(new_computed_blocks)
        if new_computed_blocks and num_dead:
            self.num_dead_blocks[req_id] = min(num_dead, len(req_blocks))   # the hits it did not take
        if req_id not in self.num_cached_block:
            self.num_cached_block[req_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if num_cross_blocks:
            self.req_to_cross_blocks[req_id] = self.block_pool.get_new_blocks(num_cross_blocks)

        if self.enable_caching:
            # NOTE: blocks become full once this step's tokens are computed; later readers are
            # in later steps, or in this step behind the per-layer KV write, so caching now is
            # safe. The just-sampled token (no KV yet) is never part of a cached block.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            num_cached = self.num_cached_block[req_id]
            if num_full > num_cached:
                self.update_block_hashes(request)
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_block[req_id] = num_full
        return [b.block_id for b in new_blocks]

    def _free_dead_blocks(self, req_id: str, req_blocks: list[KVCacheBlock], num_dead: int) -> None:
        """Return the request's blocks before index ``num_dead`` (out of its window) to the pool, later ones
        first (as ``free``), the null block taking their places."""
        done = self.num_dead_blocks.get(req_id, 0)
        upto = min(num_dead, len(req_blocks))
        if upto <= done:
            return
        dead = req_blocks[done:upto]
        req_blocks[done:upto] = [self.block_pool.null_block] * (upto - done)
        self.block_pool.free_blocks(reversed(dead))
        self.num_dead_blocks[req_id] = upto

    def _peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` computed ``chunk_tokens`` at a time holds at once: all
        of them, or with a window the blocks of a window and of one chunk."""
        num_blocks = cdiv(num_tokens, self.block_size)
        if self.sliding_window is None:
            return num_blocks
        return min(num_blocks, cdiv(self.sliding_window - 1 + chunk_tokens, self.block_size) + 1)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the chain's tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.num_dead_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        self.block_pool.free_blocks(self.req_to_cross_blocks.pop(request.request_id, []))

    def uncache(self, request: Request) -> None:
        """Take the request's blocks out of the prefix cache, before freeing them after a failed step:
        blocks hashed when they were allocated may never have received their KV."""
        self.block_pool.uncache_blocks(self.req_to_blocks.get(request.request_id, []))

    # --- queries ------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_cross_block_ids(self, request_id: str) -> list[int]:
        """The blocks of the request's cross-attention K/V (empty for decoder-only requests)."""
        return [b.block_id for b in self.req_to_cross_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def can_fit_ever(self, num_tokens: int, num_cross_tokens: int = 0) -> bool:
        """Whether ``num_tokens`` tokens of KV (plus ``num_cross_tokens`` of cross-attention K/V) fit in
        the whole (empty) cache: with a window, the blocks of a window and of the largest chunk."""
        chunk = self.max_chunk_tokens or num_tokens
        num_blocks = self._peak_blocks(num_tokens, chunk) + cdiv(num_cross_tokens, self.block_size)
        return num_blocks <= self.block_pool.num_usable_blocks

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
