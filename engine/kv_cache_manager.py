"""Per-request KV block lists on top of the block pool, with prefix caching.

A request's ``block_hashes`` cover every FULL block of ``all_token_ids`` (prompt and generated
tokens), chained, with extra keys so that KV computed under a different adapter, different
media or a different cache salt never matches:

- the adapter's ``(lora_name, lora_int_id)`` on every block of a LoRA request: the id changes
  when an adapter is unloaded and another is loaded under the same name, so stale KV never hits;
- ``(identifier, offset of the item relative to the block start)`` for each media item whose
  placeholder range overlaps the block;
- ``cache_salt`` on the first block only (the chain carries it to every later block).

Sliding windows (``sliding_window``: set when every layer of the model attends within that window; with
several KV cache groups, a sliding group's window): the chunk starting at position p reads keys from
p - window + 1 on, so each allocation first returns the request's blocks entirely before that key to the
pool; their places in the request's list (and in the runner's block table, which is never read there)
take the null block. A returned block keeps its hash like any freed block: its KV is that of its prefix,
so a later request may still hit it. A hit needs only the blocks of the window before its end cached, not
the earlier ones (they stand as the null block: no query of the request reads them). The scheduler counts
what a request still needs: the blocks of its window and of its next chunk.

KV cache groups (``engine.kv_cache_groups``: a model whose layers do not all share one window): each group
of layers has its own block list per request, out of the one pool, and its own window (the sliding rules
above apply to a sliding group's list; a full group keeps every block). Every list has a place per block of
the request's tokens, so allocations take as many blocks in each group; a prefix hit is the longest that
hits in every group (each group's blocks are cached under their own keys, ``block_pool.cache_key``). With
one group (every layer the same window, or none) the manager is the group's: lists and ids are plain, as
``PerGroup`` says.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

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


class PerGroup(list):
    """Group 0's items (a plain list, as with one KV cache group) with ``groups``: every group's list, group 0's
    first. What ``get_computed_blocks`` and ``allocate_slots`` return when the model has several groups."""

    def __init__(self, groups: list[list]) -> None:
        super().__init__(groups[0])
        self.groups = groups


def group_lists(items: Optional[list]) -> Optional[list[list]]:
    """Every group's list of a ``PerGroup`` (a plain list: the one group's); None stays None."""
    if items is None:
        return None
    return getattr(items, "groups", None) or [items]


class _GroupBlocks:
    """One KV cache group's block list per request (window: the group's; None: every block is kept)."""

    def __init__(self, group: int, window: Optional[int], block_size: int, pool: BlockPool) -> None:
        self.group = group
        self.window = window
        self.block_size = block_size
        self.pool = pool
        # req_id -> its blocks, in token order (the null block in place of those returned out of the window).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # req_id -> how many of its leading blocks are out of its window (returned, the null block in place).
        self.num_dead_blocks: dict[str, int] = {}

    def find(self, hashes: list[int]) -> tuple[list[Optional[KVCacheBlock]], list[bool]]:
        """Each hash's cached block of this group (None: not cached), and for k = 0..len(hashes) whether the
        first k blocks make a usable hit: all cached (no window); with a window, the blocks holding the keys
        the query at position k * block_size reads (from its window's start) are all cached (the earlier ones
        need not be: their KV is never read again, and they stand as the null block)."""
        found = [self.pool.get_cached_block(h, self.group) for h in hashes]
        valid = [True] * (len(hashes) + 1)
        run = 0                         # cached blocks ending at the current one
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            first_needed = window_start((i + 1) * self.block_size, self.window) // self.block_size
            valid[i + 1] = run >= i + 1 - first_needed
        return found, valid

    def hit_blocks(self, found: list[Optional[KVCacheBlock]], num_blocks: int) -> list[KVCacheBlock]:
        """The hit of ``num_blocks`` blocks (valid per ``find``), the null block before the window."""
        first_needed = window_start(num_blocks * self.block_size, self.window) // self.block_size
        return [found[i] if i >= first_needed else self.pool.null_block for i in range(num_blocks)]

    def num_dead(self, num_computed: int) -> int:
        """Leading blocks before the window of a chunk starting at ``num_computed``."""
        return window_start(num_computed, self.window) // self.block_size

    def free_dead_blocks(self, req_id: str, num_dead: int) -> None:
        """Return the request's blocks before index ``num_dead`` (out of its window) to the pool, later ones
        first (as ``free``), the null block taking their places."""
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is None:
            return
        done = self.num_dead_blocks.get(req_id, 0)
        upto = min(num_dead, len(req_blocks))
        if upto <= done:
            return
        dead = req_blocks[done:upto]
        req_blocks[done:upto] = [self.pool.null_block] * (upto - done)
        self.pool.free_blocks(reversed(dead))
        self.num_dead_blocks[req_id] = upto

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` computed ``chunk_tokens`` at a time holds at once in
        this group: all of them, or with a window the blocks of a window and of one chunk."""
        num_blocks = cdiv(num_tokens, self.block_size)
        if self.window is None:
            return num_blocks
        return min(num_blocks, cdiv(self.window - 1 + chunk_tokens, self.block_size) + 1)

    def take(self, req_id: str, hits: list[KVCacheBlock], num_dead: int, num_new: int) -> list[int]:
        """Append the prefix hits (first allocation only) and ``num_new`` new blocks to the request's list;
        the ids of the new ones."""
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is not None and not num_new and not hits:
            return []
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
        if hits:
            assert not req_blocks, "prefix hits are only taken on the first allocation"
            self.pool.touch(b for b in hits if not b.is_null)
            req_blocks.extend(hits)
            if num_dead:
                self.num_dead_blocks[req_id] = min(num_dead, len(req_blocks))   # the hits it did not take
        if req_id not in self.num_cached_block:
            self.num_cached_block[req_id] = len(hits)
        new_blocks = self.pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache(self, req_id: str, block_hashes: list[int], num_full: int) -> None:
        """Register the request's blocks up to ``num_full`` in the prefix cache."""
        num_cached = self.num_cached_block[req_id]
        if num_full > num_cached:
            self.pool.cache_full_blocks(self.req_to_blocks[req_id], block_hashes, num_cached, num_full, self.group)
            self.num_cached_block[req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first (so the chain's tail is evicted first)."""
        blocks = self.req_to_blocks.pop(req_id, [])
        self.num_cached_block.pop(req_id, None)
        self.num_dead_blocks.pop(req_id, None)
        self.pool.free_blocks(reversed(blocks))


class KVCacheManager:
    """Which KV blocks each request holds, and prefix-cache lookups, over one block pool for every KV cache
    group.

    Args:
        block_size: tokens per block.
        num_blocks: blocks in the cache, including the reserved null block 0.
        max_model_len: prompt + output tokens per request at most.
        enable_caching: reuse full blocks across requests by hash.
        sliding_window: positions every layer attends within; blocks before a request's window are
            returned to the pool while it runs (None: every block is kept). Ignored with ``group_windows``.
        max_chunk_tokens: the most tokens one step computes for a request (the scheduler's token
            budget): with a window, it bounds the blocks a request holds at once.
        group_windows: each KV cache group's window (``engine.kv_cache_groups.KVCacheGroups.group_windows``);
            None: one group of window ``sliding_window``.
    """

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 enable_caching: bool = True, sliding_window: Optional[int] = None,
                 max_chunk_tokens: Optional[int] = None,
                 group_windows: Optional[Sequence[Optional[int]]] = None) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.max_chunk_tokens = max_chunk_tokens
        self.block_pool = BlockPool(num_blocks, enable_caching)
        windows = list(group_windows) if group_windows else [sliding_window]
        self.groups = [_GroupBlocks(g, w, block_size, self.block_pool) for g, w in enumerate(windows)]
        """One block list per request in each KV cache group, group 0 first."""
        self._any_window = any(w is not None for w in windows)
        self._no_dead = [0] * len(windows)
        self._no_hits = [[] for _ in windows]
        self.sliding_window = windows[0] if len(windows) == 1 else None
        """The window of every layer (one group); None: some layer attends to the whole context, or the
        groups' windows differ."""
        # req_id -> blocks holding its cross-attention K/V (encoder-decoder models), taken with its
        # first allocation, never prefix-cached, freed with its other blocks.
        self.req_to_cross_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix-cache counters, in tokens, since start.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Group 0's counts of leading blocks registered in the prefix cache."""
        return self.groups[0].num_cached_block

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's block lists (every layer's, with one group)."""
        return self.groups[0].req_to_blocks

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
        """Longest run of cached full blocks at the start of the request, in every group.

        The hit is capped at ``num_tokens - 1`` tokens so the last token is always recomputed
        (its logits are needed). Requests asking for prompt logprobs skip the lookup.

        Returns:
            (blocks, num_computed_tokens): the hit blocks (not yet referenced; pass them to
            ``allocate_slots``; a ``PerGroup`` with several groups) and the tokens they cover.
        """
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or request.num_cross_tokens):
            # NOTE: an encoder-decoder request recomputes from token 0 (its cross K/V are written there).
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_hit_blocks]
        if len(self.groups) == 1 and self.sliding_window is None:
            blocks = []
            for block_hash in hashes:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:
                    break
                blocks.append(block)
        else:
            looked = [g.find(hashes) for g in self.groups]
            best = max(k for k in range(len(hashes) + 1) if all(valid[k] for _, valid in looked))
            per_group = [g.hit_blocks(found, best) for g, (found, _) in zip(self.groups, looked)]
            blocks = per_group[0] if len(per_group) == 1 else PerGroup(per_group)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

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
            Ids of the blocks newly allocated (excluding prefix hits; a ``PerGroup`` with several groups), or
            None when the pool does not have enough free blocks; on None nothing changed (but blocks out of
            the request's window, which are returned either way).
        """
        groups = self.groups
        req_id = request.request_id
        bs = self.block_size
        held = groups[0].req_to_blocks.get(req_id)
        num_held_before = len(held) if held is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = min(num_computed + num_new_tokens, self.max_model_len)
        num_held = num_held_before + (len(new_computed_blocks) if new_computed_blocks else 0)
        num_new_blocks = max(0, cdiv(num_tokens_after, bs) - num_held)   # in each group
        # With a window: blocks before the chunk's first key are never read again. The request's own go
        # back to the pool now (whether or not this allocation succeeds), prefix hits there are not taken.
        num_dead = self._no_dead
        if self._any_window:
            num_dead = [window_start(num_computed, g.window) // bs for g in groups]
            for g, dead in zip(groups, num_dead):
                g.free_dead_blocks(req_id, dead)
        hits, num_evictable_hits = self._no_hits, 0
        if new_computed_blocks:
            null = self.block_pool.null_block
            hits = [[null if num_held_before + i < dead else b for i, b in enumerate(group_hits)]
                    for group_hits, dead in zip(group_lists(new_computed_blocks), num_dead)]
            # Prefix hits sitting in the free queue stop being free once touched.
            num_evictable_hits = sum(1 for group_hits in hits for b in group_hits
                                     if b.ref_cnt == 0 and not b.is_null)
        num_cross_blocks = 0
        if request.num_cross_tokens and req_id not in self.req_to_cross_blocks:
            num_cross_blocks = cdiv(request.num_cross_tokens, bs)
        num_needed = num_new_blocks * len(groups) + num_evictable_hits + num_cross_blocks
        if full_sequence_must_fit:
            num_full_seq_blocks = sum(max(0, g.peak_blocks(request.num_tokens, num_new_tokens)
                                          - (num_held - min(dead, num_held)))
                                      for g, dead in zip(groups, num_dead))
            num_needed = max(num_needed, num_full_seq_blocks + num_evictable_hits + num_cross_blocks)
        if num_needed > self.block_pool.num_free_blocks:
            return None

        new_ids = [g.take(req_id, group_hits, dead, num_new_blocks)
                   for g, group_hits, dead in zip(groups, hits, num_dead)]
        if num_cross_blocks:
            self.req_to_cross_blocks[req_id] = self.block_pool.get_new_blocks(num_cross_blocks)

        if self.enable_caching:
            # NOTE: blocks become full once this step's tokens are computed; later readers are
            # in later steps, or in this step behind the per-layer KV write, so caching now is
            # safe. The just-sampled token (no KV yet) is never part of a cached block. Every group
            # has cached as many blocks (hits are as long in each).
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // bs
            if num_full > groups[0].num_cached_block[req_id]:
                self.update_block_hashes(request)
                for g in groups:
                    g.cache(req_id, request.block_hashes, num_full)
        return new_ids[0] if len(new_ids) == 1 else PerGroup(new_ids)

    def _peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` computed ``chunk_tokens`` at a time holds at once, in
        every group together: all of them, or in a group with a window the blocks of a window and of one
        chunk."""
        return sum(g.peak_blocks(num_tokens, chunk_tokens) for g in self.groups)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the chain's tail is evicted first)."""
        for g in self.groups:
            g.free(request.request_id)
        self.block_pool.free_blocks(self.req_to_cross_blocks.pop(request.request_id, []))

    def uncache(self, request: Request) -> None:
        """Take the request's blocks out of the prefix cache, before freeing them after a failed step:
        blocks hashed when they were allocated may never have received their KV."""
        for g in self.groups:
            self.block_pool.uncache_blocks(g.req_to_blocks.get(request.request_id, []))

    # --- queries ------------------------------------------------------------------------
    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's blocks in KV cache group ``group`` (the null block 0 where returned)."""
        return [b.block_id for b in self.groups[group].req_to_blocks.get(request_id, [])]

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
