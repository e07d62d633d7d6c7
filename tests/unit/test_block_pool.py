"""Block pool: null block, ref counts, free-queue (eviction) order, lazy hash eviction, hashing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.block_pool import NONE_HASH, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_null_block_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4 == pool.num_usable_blocks
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # freeing the null block is a no-op
    assert pool.num_free_blocks == 0


def test_ref_counts_touch_and_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    assert b.ref_cnt == 1
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b.block_id not in free_ids(pool)
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and free_ids(pool)[-1] == b.block_id
    # touch of a free block unlinks it from the middle of the queue
    assert free_ids(pool) == [2, 3, 1]
    pool.touch([pool.blocks[3]])
    assert free_ids(pool) == [2, 1] and pool.num_free_blocks == 2 and pool.blocks[3].ref_cnt == 1
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.blocks[2]])  # double free of a free block


def test_eviction_order_least_recently_freed_first_chain_tail_first():
    pool = BlockPool(7)
    req_a = pool.get_new_blocks(3)  # 1 2 3
    req_b = pool.get_new_blocks(3)  # 4 5 6
    pool.free_blocks(reversed(req_a))
    pool.free_blocks(reversed(req_b))
    assert free_ids(pool) == [3, 2, 1, 6, 5, 4]
    assert [b.block_id for b in pool.get_new_blocks(6)] == [3, 2, 1, 6, 5, 4]


def test_lazy_hash_eviction_and_hit_from_free_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, (1, 2)), hash_block_tokens(None, (3, 4))]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))
    # freed blocks keep their hash: still a hit
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert free_ids(pool) == [3, 2, 1]
    # first pop takes the never-used block 3; cached blocks survive
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    # next pop takes block 2 (chain tail, freed first) and drops its hash only now
    (b2,) = pool.get_new_blocks(1)
    assert b2 is blocks[1] and b2.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_same_hash_in_two_blocks_survives_one_eviction():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, (7, 7))
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert set(pool.cached_block_hash_to_block[h]) == {a.block_id, b.block_id}
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # pops 3, then a
    assert pool.get_cached_block(h) is b


def test_cache_full_blocks_disabled():
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [123], 0, 1)
    assert blocks[0].block_hash is None and pool.get_cached_block(123) is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = [11, 22]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(11) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(11) is None and all(b.block_hash is None for b in pool.blocks)
    assert pool.get_usage() == 0.0


def test_free_queue_popleft_n_and_errors():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    with pytest.raises(ValueError):
        q.popleft_n(2)
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [2, 0]


def test_hash_chaining_and_extra_keys():
    h1 = hash_block_tokens(None, (1, 2, 3))
    assert h1 == hash_block_tokens(NONE_HASH, (1, 2, 3))
    assert 0 <= h1 < 2 ** 64
    assert hash_block_tokens(h1, (4, 5, 6)) != hash_block_tokens(None, (4, 5, 6))
    assert hash_block_tokens(None, (1, 2, 3), ("a",)) != h1
    assert hash_block_tokens(None, (1, 2, 3), ("a",)) != hash_block_tokens(None, (1, 2, 3), ("b",))
    img0 = hash_block_tokens(None, (1, 2, 3), (("img", 0),))
    assert img0 != hash_block_tokens(None, (1, 2, 3), (("img", 1),))


def test_hash_is_stable_across_processes():
    code = ("from engine.block_pool import hash_block_tokens as h; "
            "print(h(h(None, (1, 2)), (3, 4), ('lora', ('img', -2))))")
    here = hash_block_tokens(hash_block_tokens(None, (1, 2)), (3, 4), ("lora", ("img", -2)))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True, cwd=root)
        assert int(out.stdout) == here
