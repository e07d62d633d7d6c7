"""KV cache groups (``engine.kv_cache_groups``) and the scheduler side over them: layers split by window into
groups of equal size; one pool, a block list per request per group; a sliding group returns the blocks before
its window while a global group keeps them; a prefix hit is the longest that hits in every group; admission,
preemption and the step messages count every group."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_groups import kv_cache_groups
from engine.kv_cache_manager import KVCacheManager, PerGroup
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeRunner, assert_no_leaks, make_request

BS = 4
W = 6
"""The sliding groups' window in positions."""


def test_gemma3_12b_is_six_groups_of_eight_layers():
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]
    groups = kv_cache_groups(windows, [(8, 256)] * 48)
    assert groups.group_size == 8 and groups.group_windows == (1024,) * 5 + (None,)
    for g in range(6):
        layers = [i for i in range(48) if groups.layer_group[i] == g]
        assert [groups.layer_slot[i] for i in layers] == list(range(8))
        assert {windows[i] for i in layers} == {groups.group_windows[g]}


def test_uneven_counts_leave_slots_unused_and_uniform_models_are_one_group():
    # Gemma 3 27B: 52 sliding, 10 global -> groups of 10; the last sliding group has 2 layers.
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]
    groups = kv_cache_groups(windows)
    assert groups.group_size == 10 and groups.group_windows == (1024,) * 6 + (None,)
    assert sorted(groups.layer_slot[i] for i in range(62) if groups.layer_group[i] == 5) == [0, 1]
    for uniform in ([None] * 4, [16] * 4):
        one = kv_cache_groups(uniform)
        assert one.group_windows == (uniform[0],) and one.layer_slot == (0, 1, 2, 3) and one.group_size == 4
    mixed_shapes = kv_cache_groups([16, None, 16], [(2, 16), (2, 32), (2, 16)])
    assert mixed_shapes.group_windows == (None,) and mixed_shapes.layer_group == (0, 0, 0)


def _manager(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(BS, num_blocks, max_model_len=512, max_chunk_tokens=8, group_windows=[W, None])


def _run_chunks(kv: KVCacheManager, req, chunk: int = 8) -> None:
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n


def test_the_sliding_group_returns_its_blocks_the_global_group_keeps_them():
    kv = _manager()
    sliding, full = kv.groups
    req = make_request("a", prompt_len=40)
    _run_chunks(kv, req)
    ids = kv.allocate_slots(req, 1)                              # the first decode step: position 40
    assert isinstance(ids, PerGroup) and len(ids.groups) == 2
    dead = (40 - W + 1) // BS
    assert [b.is_null for b in sliding.req_to_blocks["a"]] == [True] * dead + [False] * (11 - dead)
    assert not any(b.is_null for b in full.req_to_blocks["a"]) and len(full.req_to_blocks["a"]) == 11
    held = (11 - dead) + 11
    assert kv.num_free_blocks == kv.num_usable_blocks - held
    assert kv.get_block_ids("a", 0)[:dead] == [0] * dead and 0 not in kv.get_block_ids("a", 1)
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_hit_is_the_prefix_every_group_holds():
    """Each group caches its own blocks of the same tokens (its own keys); evicting the global group's tail
    shortens the hit for both, evicting the sliding group's head does not shorten it."""
    kv = _manager()
    first = make_request("a", prompt_len=40)
    _run_chunks(kv, first)
    sliding_blocks = list(kv.groups[0].req_to_blocks["a"])
    full_blocks = list(kv.groups[1].req_to_blocks["a"])
    kv.free(first)
    hashes = first.block_hashes
    assert kv.block_pool.get_cached_block(hashes[9], 0) is sliding_blocks[9]
    assert kv.block_pool.get_cached_block(hashes[9], 1) is full_blocks[9]
    second = make_request("b", prompt_token_ids=first.prompt_token_ids + [7, 8])
    hits, n = kv.get_computed_blocks(second)
    assert n == 40 and [len(g) for g in hits.groups] == [10, 10]
    assert [b.is_null for b in hits.groups[0]] == [True] * 8 + [False] * 2   # the window of position 40
    assert hits.groups[1] == full_blocks[:10]
    kv.block_pool.uncache_blocks(sliding_blocks[:5])             # before the sliding window: still a full hit
    assert kv.get_computed_blocks(second)[1] == 40
    kv.block_pool.uncache_blocks(full_blocks[7:8])               # the global group misses block 7: 7 blocks
    hits, n = kv.get_computed_blocks(second)
    assert n == 28 and [len(g) for g in hits.groups] == [7, 7] and not any(b.is_null for b in hits.groups[1])
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(second, second.num_tokens - n, hits, n) is not None
    live_hits = sum(1 for g in hits.groups for b in g if not b.is_null)
    new_blocks = 2 * (-(-second.num_tokens // BS) - 7)
    assert kv.num_free_blocks == free_before - live_hits - new_blocks
    kv.free(second)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_admission_counts_every_group():
    # A 400-token request: 100 blocks in the global group, a window and a chunk (ceil(13 / 4) + 1) in the sliding.
    assert KVCacheManager(BS, 106, 512, max_chunk_tokens=8, group_windows=[W, None]).can_fit_ever(400)
    assert not KVCacheManager(BS, 105, 512, max_chunk_tokens=8, group_windows=[W, None]).can_fit_ever(400)
    assert not KVCacheManager(BS, 106, 512, max_chunk_tokens=8, group_windows=[None, None]).can_fit_ever(400)


def _scheduler(num_blocks: int, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), max_model_len=512,
                     num_kv_blocks=num_blocks, kv_group_windows=[W, None, W])


def test_steps_send_every_groups_blocks_and_preempt_when_full():
    """Three requests in a cache too small for all: each step's messages carry every group's blocks (the fake
    runner's tables match the manager's lists and the pool's reference counts), some are preempted and
    recomputed, and nothing leaks."""
    sched = _scheduler(num_blocks=28, caching=False)
    runner = FakeRunner(sched)
    for i, n in enumerate((40, 30, 24)):
        sched.add_request(make_request(f"r{i}", prompt_len=n, max_tokens=12, ignore_eos=True))
    outputs = runner.run()
    assert set(outputs) == {"r0", "r1", "r2"} and sched.num_preemptions > 0
    assert any(so.scheduled_cached_reqs.new_group_block_ids for so in runner.history)
    assert all(len(nr.group_block_ids) == 2 for so in runner.history for nr in so.scheduled_new_reqs)
    assert_no_leaks(sched)


def test_prefix_hits_through_the_scheduler():
    sched = _scheduler(num_blocks=80)
    runner = FakeRunner(sched)
    first = make_request("a", prompt_len=40, max_tokens=2, ignore_eos=True)
    sched.add_request(first)
    runner.run()
    sched.add_request(make_request("b", prompt_token_ids=first.prompt_token_ids + [7, 8], max_tokens=2,
                                   ignore_eos=True))
    runner.step()
    assert sched.requests["b"].num_cached_tokens == 40              # 10 blocks in each of the 3 groups
    runner.run()
    assert_no_leaks(sched)


def test_the_runner_lays_out_a_slot_mapping_and_block_table_per_group():
    """Group tables take each request's row of group 0's table; a step's metadata for group g reads group g's
    blocks (its slots: block * block_size + offset), padding rows and tokens as group 0's."""
    import torch

    from engine.input_batch import StepBuffers
    from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from engine.runner.state import RequestStates
    from engine.sampling_params import SamplingParams

    states = RequestStates(4, 8, 0, torch.device("cpu"), None, None, num_kv_groups=3)
    new = tuple(NewRequestData(req_id=r, all_token_ids=tuple(range(6)), num_prompt_tokens=6,
                               sampling_params=SamplingParams(), block_ids=(10 + i, 11 + i), cross_block_ids=(),
                               num_computed_tokens=0, group_block_ids=((20 + i, 21 + i), (30 + i, 31 + i)))
                for i, r in enumerate("ab"))
    states.apply(SchedulerOutput(new, CachedRequestData(), {"a": 6, "b": 6}, 12))
    states.apply(SchedulerOutput((), CachedRequestData(
        req_ids=("b",), new_block_ids=((12,),), num_computed_tokens=(6,), lora_slots=(-1,),
        new_group_block_ids=(((0,), (42,)),)), {"b": 1}, 1))
    b = states.requests["b"]
    b.token_ids.append(7)                                         # the token sampled at position 5
    assert [list(t.rows[b.row, :3]) for t in [states.block_table, *states.group_tables]] == [
        [11, 12, 12], [21, 22, 0], [31, 32, 42]]
    buffers = StepBuffers(16, 4, 8, torch.device("cpu"), num_groups=3)
    inputs = buffers.prepare([b], [1], states.block_table, BS, with_lora=False, num_reqs_padded=2,
                             group_tables=states.group_tables)
    meta = inputs.attn_metadata                                   # position 6: block 1, offset 2
    assert [m.slot_mapping.tolist() for m in (meta.for_group(0), meta.for_group(1), meta.for_group(2))] == [
        [12 * BS + 2, -1], [22 * BS + 2, -1], [32 * BS + 2, -1]]
    assert meta.for_group(2).block_tables[:, :3].tolist() == [[31, 32, 42], [0, 0, 0]]
    meta.key_limit = torch.zeros(2, dtype=torch.int32)
    assert meta.for_group(1).key_limit is meta.key_limit and meta.for_group(1).seq_lens is meta.seq_lens
