"""KV cache manager: request block hashes with extra keys, prefix hits, allocation, freeing."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager, block_extra_keys
from tests.unit.fakes import lora, make_request, mm_feature, prompt_tokens

BS = 4


def manager(num_blocks: int = 32, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BS, num_blocks, max_model_len=256, enable_caching=enable_caching)


def hashes(req, kv=None):
    (kv or manager()).update_block_hashes(req)
    return list(req.block_hashes)


def run_prefill(kv: KVCacheManager, req) -> list[int]:
    """Admit ``req`` with its prefix hits and compute the whole prompt."""
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_hit)
    assert ids is not None
    req.num_computed_tokens = req.num_tokens
    return ids


def test_hashes_cover_full_blocks_only_and_grow_with_outputs():
    kv = manager()
    req = make_request("a", prompt_len=10)
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 2
    first = list(req.block_hashes)
    req.append_output_token_ids([5])
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([6])
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 3 and req.block_hashes[:2] == first
    # generated tokens are part of the chain: same prompt + different outputs -> different hash
    other = make_request("b", prompt_token_ids=req.prompt_token_ids)
    other.append_output_token_ids([5, 7])
    assert hashes(other)[:2] == first and hashes(other)[2] != req.block_hashes[2]


def test_lora_name_changes_every_block_hash():
    tokens = prompt_tokens("x", 12)
    base = hashes(make_request("b", prompt_token_ids=tokens))
    a1 = hashes(make_request("a1", prompt_token_ids=tokens, lora_request=lora("sql")))
    a2 = hashes(make_request("a2", prompt_token_ids=tokens, lora_request=lora("sql")))
    b = hashes(make_request("c", prompt_token_ids=tokens, lora_request=lora("chat")))
    assert a1 == a2
    assert all(x != y for x, y in zip(a1, base)) and all(x != y for x, y in zip(a1, b))


def test_mm_extra_keys_identifier_and_offset():
    tokens = prompt_tokens("mm", 16)
    # image covers tokens 5..10 -> blocks 1 and 2
    req = make_request("m", prompt_token_ids=tokens, mm_features=[mm_feature("img-A", 5, 6)])
    assert block_extra_keys(req, 0, 4) is None
    assert block_extra_keys(req, 4, 8) == (("img-A", 1),)
    assert block_extra_keys(req, 8, 12) == (("img-A", -3),)
    assert block_extra_keys(req, 12, 16) is None
    plain = hashes(make_request("p", prompt_token_ids=tokens))
    h_a = hashes(req)
    h_b = hashes(make_request("m2", prompt_token_ids=tokens, mm_features=[mm_feature("img-B", 5, 6)]))
    h_shift = hashes(make_request("m3", prompt_token_ids=tokens, mm_features=[mm_feature("img-A", 6, 5)]))
    assert h_a[0] == plain[0] == h_b[0] == h_shift[0]  # blocks before the image are shared
    for other in (plain, h_b, h_shift):
        assert all(x != y for x, y in zip(h_a[1:], other[1:]))  # from the image on, nothing is


def test_cache_salt_on_first_block_changes_every_hash():
    tokens = prompt_tokens("s", 12)
    req = make_request("s1", prompt_token_ids=tokens, cache_salt="tenant-1")
    assert block_extra_keys(req, 0, 4) == (("salt", "tenant-1"),)
    assert block_extra_keys(req, 4, 8) is None
    plain = hashes(make_request("p", prompt_token_ids=tokens))
    salted = hashes(req)
    other_salt = hashes(make_request("s2", prompt_token_ids=tokens, cache_salt="tenant-2"))
    assert all(x != y for x, y in zip(salted, plain))
    assert all(x != y for x, y in zip(salted, other_salt))
    assert salted == hashes(make_request("s3", prompt_token_ids=tokens, cache_salt="tenant-1"))


def test_prefix_hit_capped_to_keep_last_token():
    kv = manager()
    tokens = prompt_tokens("p", 16)
    run_prefill(kv, make_request("a", prompt_token_ids=tokens + [1]))
    # exactly 4 full blocks of prompt: the hit stops at 3 blocks so the last token is recomputed
    blocks, n = kv.get_computed_blocks(make_request("b", prompt_token_ids=tokens))
    assert n == 12 and len(blocks) == 3
    # one more token: all 4 blocks hit
    blocks, n = kv.get_computed_blocks(make_request("c", prompt_token_ids=tokens + [9]))
    assert n == 16
    assert [blk.block_id for blk in blocks] == kv.get_block_ids("a")[:4]


def test_hits_and_queries_counted_in_tokens():
    kv = manager()
    tokens = prompt_tokens("q", 9)
    run_prefill(kv, make_request("a", prompt_token_ids=tokens))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    kv.get_computed_blocks(make_request("b", prompt_token_ids=tokens))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 8)


def test_prompt_logprobs_skip_lookup_and_no_caching_mode():
    kv = manager()
    tokens = prompt_tokens("l", 9)
    run_prefill(kv, make_request("a", prompt_token_ids=tokens))
    assert kv.get_computed_blocks(make_request("b", prompt_token_ids=tokens, prompt_logprobs=1)) == ([], 0)
    kv_off = manager(enable_caching=False)
    run_prefill(kv_off, make_request("a", prompt_token_ids=tokens))
    assert kv_off.get_computed_blocks(make_request("b", prompt_token_ids=tokens)) == ([], 0)
    assert not kv_off.block_pool.cached_block_hash_to_block


def test_allocation_failure_has_no_side_effects():
    kv = manager(num_blocks=6)  # 5 usable
    tokens = prompt_tokens("f", 12)
    a = make_request("a", prompt_token_ids=tokens + [1])
    run_prefill(kv, a)  # 4 blocks
    kv.free(a)  # cached, evictable
    b = make_request("b", prompt_token_ids=tokens + [2, 3, 4, 5, 6, 7, 8, 9, 10])  # 21 tokens: 6 blocks
    hit_blocks, n = kv.get_computed_blocks(b)
    assert n == 12
    before = ([blk.ref_cnt for blk in kv.block_pool.blocks], kv.num_free_blocks,
              dict(kv.block_pool.cached_block_hash_to_block))
    assert kv.allocate_slots(b, b.num_tokens - n, hit_blocks, n) is None
    after = ([blk.ref_cnt for blk in kv.block_pool.blocks], kv.num_free_blocks,
             dict(kv.block_pool.cached_block_hash_to_block))
    assert before == after
    assert kv.get_block_ids("b") == [] and "b" not in kv.num_cached_block


def test_free_then_rehit_takes_blocks_back_from_the_free_queue():
    kv = manager(num_blocks=10)
    tokens = prompt_tokens("r", 12)
    a = make_request("a", prompt_token_ids=tokens + [1])
    run_prefill(kv, a)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0
    b = make_request("b", prompt_token_ids=tokens + [2])
    new_ids = run_prefill(kv, b)
    assert kv.get_block_ids("b")[:3] == a_blocks[:3]
    assert len(new_ids) == 1 and new_ids[0] not in a_blocks[:3]
    assert kv.num_free_blocks == 9 - 4
    assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in a_blocks[:3])
    # a second sharer of the same prefix: ref counts 2, no extra free blocks consumed for hits
    c = make_request("c", prompt_token_ids=tokens + [3])
    run_prefill(kv, c)
    assert all(kv.block_pool.blocks[i].ref_cnt == 2 for i in a_blocks[:3])
    assert kv.num_free_blocks == 9 - 5
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == 9


def test_hit_blocks_in_free_queue_count_against_free_space():
    kv = manager(num_blocks=5)  # 4 usable
    tokens = prompt_tokens("e", 8)
    a = make_request("a", prompt_token_ids=tokens + [1])
    run_prefill(kv, a)  # 3 blocks
    kv.free(a)
    b = make_request("b", prompt_token_ids=tokens + [2] * 9)  # 17 tokens: 5 blocks > 4 usable
    hit_blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hit_blocks, n) is None
    # 2 hit blocks (free) + 2 new blocks = all 4 usable blocks
    assert kv.allocate_slots(b, 16 - n, hit_blocks, n) is not None
    assert kv.num_free_blocks == 0


def test_incremental_allocation_and_caching_of_generated_blocks():
    kv = manager()
    a = make_request("a", prompt_len=6)
    assert kv.allocate_slots(a, 6) is not None  # 2 blocks, 1 full
    a.num_computed_tokens = 6
    assert kv.num_cached_block["a"] == 1
    a.append_output_token_ids([100])  # token 6 computed this step: block 1 not full yet
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    a.append_output_token_ids([101])
    assert kv.num_cached_block["a"] == 1  # token 7 sampled, no KV yet: block 1 not cacheable
    assert kv.allocate_slots(a, 1) == []  # token 7 computed this step fills block 1
    a.num_computed_tokens += 1
    assert kv.num_cached_block["a"] == 2
    a.append_output_token_ids([102])
    assert len(kv.allocate_slots(a, 1)) == 1  # token 8 needs block 2
    assert kv.block_pool.get_cached_block(a.block_hashes[1]).block_id == kv.get_block_ids("a")[1]


def test_full_sequence_must_fit_gate_and_can_fit_ever():
    kv = manager(num_blocks=5)  # 4 usable = 16 tokens
    assert kv.can_fit_ever(16) and not kv.can_fit_ever(17)
    a = make_request("a", prompt_len=8)
    kv.allocate_slots(a, 8)
    b = make_request("b", prompt_len=12)
    assert kv.allocate_slots(b, 4, full_sequence_must_fit=True) is None
    assert kv.allocate_slots(b, 4) is not None
