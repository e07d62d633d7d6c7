"""KV blocks, the free queue (which is also the eviction order), and prefix-block hashing.

Pure Python over ints: the runner owns the tensors; this module only decides which block id
holds which tokens.

Eviction order: a block whose ``ref_cnt`` drops to 0 goes to the TAIL of the free queue but
keeps its hash, so a later request can still hit it. New blocks are popped from the HEAD, and
only then is a popped block's hash dropped from the hash map (lazy eviction). Requests free
their blocks in reverse order, so within one chain the tail block (least likely to be shared)
is evicted first, and across requests the least recently freed block goes first.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable
from typing import Any, Optional

BlockHash = int
"""Chained hash of one full block: 64-bit int."""


def cache_key(block_hash: BlockHash, group: int) -> Any:
    """The prefix-cache key of a KV cache group's block holding ``block_hash``'s tokens: the hash itself for
    group 0, (hash, group) for the others (each group holds its own layers' KV of the same tokens)."""
    return block_hash if group == 0 else (block_hash, group)


def _digest64(obj: Any) -> int:
    # NOTE: pickle of tuples of ints/str/None is deterministic across processes; Python's hash()
    # is salted per process and would make hashes unstable, so it is never used here.
    return int.from_bytes(hashlib.sha256(pickle.dumps(obj, protocol=4)).digest()[:8], "little")


NONE_HASH: BlockHash = _digest64("chorus-prefix-cache-root")
"""Parent hash of the first block of every request (fixed, so hashes are reproducible)."""


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: tuple[int, ...],
                      extra_keys: Optional[tuple[Any, ...]] = None) -> BlockHash:
    """Hash one full block, chained on its parent.

    Args:
        parent_hash: hash of the previous block, or None for the first block (uses NONE_HASH).
        token_ids: the block's token ids.
        extra_keys: what else makes the KV differ (adapter name, media ids with offsets,
            cache salt), or None.

    Returns:
        A 64-bit int (sha256 over the pickled triple, truncated).
    """
    parent = NONE_HASH if parent_hash is None else parent_hash
    return _digest64((parent, tuple(token_ids), extra_keys))


class KVCacheBlock:
    """One KV block: an id into the runner's KV tensors plus bookkeeping."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Requests holding this block; 0 means it sits in the free queue.
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache (``cache_key``); dropped on eviction.
        self.block_hash: Optional[Any] = None
        # Free-queue links (None when not in the queue).
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None
        # Block 0: the padding block the runner points unused block-table entries at.
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks with fake head and tail: O(1) everywhere.

    Order = eviction order: pop from the head, append freed blocks at the tail, unlink from the
    middle on a prefix hit.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("No free KV blocks left.")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Asked for {n} free KV blocks, only {self.num_free_blocks} left.")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None and block.next_free_block is None, "already free"
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (eviction order); for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks, the free queue, and the prefix-cache map hash -> blocks.

    Args:
        num_blocks: blocks in the KV cache, including the reserved null block 0.
        enable_caching: keep hashes of full blocks so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is reserved).")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # NOTE: block 0 never leaves this pool: runners pad block tables with 0.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # cache_key -> {block_id: block}. Identical full blocks are not de-duplicated (block tables
        # stay append-only), so one hash can map to several blocks.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    # --- queries ------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (free or cached-but-evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> Optional[KVCacheBlock]:
        """A block of KV cache group ``group`` holding ``block_hash``'s KV, or None."""
        blocks = self.cached_block_hash_to_block.get(cache_key(block_hash, group))
        if not blocks:
            return None
        return next(iter(blocks.values()))

    # --- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free queue, evicting their cached hashes."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks (unlinking free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the tail in the given order.

        Callers pass a request's blocks in reverse so the chain's tail is evicted first.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int, group: int = 0) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (of KV cache group ``group``) under their
        hashes; the null block (out of a sliding window) is skipped."""
        if not self.enable_caching:
            return
        assert len(block_hashes) >= num_full_blocks <= len(blocks), (
            len(block_hashes), num_full_blocks, len(blocks))
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            key = cache_key(block_hashes[i], group)
            if block.block_hash is not None:
                # A prefix-hit block already registered under this very hash.
                assert block.block_hash == key
                continue
            block.block_hash = key
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks out of the prefix cache (their KV may never have been written); held
        blocks stay held."""
        for block in blocks:
            self._maybe_evict_cached_block(block)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        blocks = self.cached_block_hash_to_block.get(block.block_hash)
        if blocks is not None:
            blocks.pop(block.block_id, None)
            if not blocks:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block.

        Returns:
            True on success, False if some blocks are still in use.
        """
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
