"""Scheduler side of sliding windows and bidirectional media: KV blocks before a request's window go back to
the pool (prefix hits there are not taken), admission counts what a request still needs, and with
``whole_media_chunks`` a prefill chunk never ends inside a media placeholder."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeRunner, assert_no_leaks, make_request, mm_feature

BS = 4


def scheduler(window=None, whole_media_chunks=False, num_blocks=64, budget=8, caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), max_model_len=512,
                     num_kv_blocks=num_blocks, max_embeds_per_mm_item=16, sliding_window=window,
                     whole_media_chunks=whole_media_chunks)


def test_blocks_before_the_window_return_to_the_pool_each_step():
    sched = scheduler(window=6, num_blocks=12)
    runner = FakeRunner(sched)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", prompt_len=60, max_tokens=30, ignore_eos=True))   # 90 tokens > 44 of cache
    while sched.requests:
        start = sched.requests["a"].num_computed_tokens
        runner.step()
        if "a" in kv.req_to_blocks:
            blocks = kv.req_to_blocks["a"]
            dead = max(0, start - 6 + 1) // BS
            assert all(b.is_null for b in blocks[:dead]) and not any(b.is_null for b in blocks[dead:])
            assert len(blocks) - dead <= kv._peak_blocks(90, 8)
            assert kv.num_free_blocks == kv.num_usable_blocks - (len(blocks) - dead)
    assert sched.num_preemptions == 0
    assert_no_leaks(sched)


def test_admission_counts_a_window_and_a_chunk():
    kv = KVCacheManager(BS, 8, max_model_len=512, sliding_window=6, max_chunk_tokens=8)
    assert kv.can_fit_ever(400)                                   # ceil((6 - 1 + 8) / 4) + 1 = 5 blocks
    assert not KVCacheManager(BS, 8, max_model_len=512).can_fit_ever(400)
    assert not KVCacheManager(BS, 5, max_model_len=512, sliding_window=6, max_chunk_tokens=8).can_fit_ever(400)
    sched = scheduler(window=None, num_blocks=8)
    with pytest.raises(ValueError, match="KV cache has 7 blocks"):
        sched.add_request(make_request("long", prompt_len=100))
    scheduler(window=6, num_blocks=8).add_request(make_request("long", prompt_len=100))


def test_prefix_hits_before_the_window_are_not_taken():
    """A second request with the same long prompt hits the first's blocks; those before its window stay in
    the pool (free, still cached), the others are taken."""
    kv = KVCacheManager(BS, 40, max_model_len=512, sliding_window=6, max_chunk_tokens=64)
    first = make_request("a", prompt_len=40)
    hits, n = kv.get_computed_blocks(first)
    assert n == 0 and kv.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    kv.free(first)                                                # all 10 blocks cached and free
    second = make_request("b", prompt_token_ids=first.prompt_token_ids + [7, 8])
    hits, n = kv.get_computed_blocks(second)
    assert n == 40 and len(hits) == 10
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(second, 2, hits, n) is not None
    blocks = kv.req_to_blocks["b"]
    dead = (40 - 6 + 1) // BS                                     # 8 blocks before the window of position 40
    assert [b.is_null for b in blocks[:dead]] == [True] * dead
    assert [b.block_id for b in blocks[dead:10]] == [b.block_id for b in hits[dead:]]
    assert kv.num_free_blocks == free_before - (10 - dead) - 1    # the live hits and one new block
    assert all(kv.block_pool.get_cached_block(h) is not None for h in second.block_hashes[:dead])
    kv.free(second)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_hit_needs_only_its_last_window_cached():
    """The head of a cached prompt evicted: a request with that prompt still hits up to where the blocks of a
    window are cached, the blocks before standing as the null block; a gap in the window ends the hit."""
    kv = KVCacheManager(BS, 40, max_model_len=512, sliding_window=6, max_chunk_tokens=64)
    first = make_request("a", prompt_len=40)
    kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    blocks = list(kv.req_to_blocks["a"])
    kv.free(first)
    kv.block_pool.uncache_blocks(blocks[:5])                     # the head's hashes gone (as if reused)
    second = make_request("b", prompt_token_ids=first.prompt_token_ids + [7, 8])
    hits, n = kv.get_computed_blocks(second)
    assert n == 40 and [b.is_null for b in hits] == [True] * 8 + [False] * 2
    assert [b.block_id for b in hits[8:]] == [b.block_id for b in blocks[8:]]
    kv.block_pool.uncache_blocks(blocks[8:9])                    # a gap: the window of position 40 misses it
    third = make_request("c", prompt_token_ids=first.prompt_token_ids + [9])
    hits, n = kv.get_computed_blocks(third)
    assert n == 32 and [b.is_null for b in hits] == [True] * 6 + [False] * 2   # keys 27..31: blocks 6, 7
    assert kv.allocate_slots(third, 9, hits, n) is not None
    assert not any(b.is_null for b in kv.req_to_blocks["c"][6:])
    kv.free(third)
    assert kv.num_free_blocks == kv.num_usable_blocks


def _chunks(sched: Scheduler, req_id: str) -> list[int]:
    runner = FakeRunner(sched)
    sizes = []
    while req_id in sched.requests and sched.requests[req_id].num_computed_tokens < sched.requests[req_id].num_tokens:
        so = runner.step().scheduler_output
        sizes.append(so.num_scheduled_tokens.get(req_id, 0))
    return sizes


@pytest.mark.parametrize("whole", [False, True])
def test_a_chunk_never_ends_inside_an_image(whole):
    """Images at tokens 5-10 and 12-19 (8 tokens, the whole budget): with ``whole_media_chunks`` the chunks end
    before each image and each holds all of it; without, the 8-token budget cuts through them."""
    sched = scheduler(whole_media_chunks=whole)
    sched.add_request(make_request("a", prompt_len=24, max_tokens=1,
                                   mm_features=[mm_feature("img1", 5, 6), mm_feature("img2", 12, 8)]))
    sizes = _chunks(sched, "a")
    assert sizes == ([5, 7, 8, 4] if whole else [8, 8, 8])


def test_an_image_longer_than_a_chunk_is_refused():
    sched = scheduler(whole_media_chunks=True, budget=8)
    with pytest.raises(ValueError, match="raise --max-num-batched-tokens"):
        sched.add_request(make_request("a", prompt_len=20, mm_features=[mm_feature("big", 2, 9)]))
    scheduler(whole_media_chunks=False, budget=8).add_request(
        make_request("a", prompt_len=20, mm_features=[mm_feature("big", 2, 9)]))
