"""The encoder-cache rules of the scheduler, on scheduler-side requests (no model): budgets in
embeddings, whole items, chunks that stop before an item that cannot be encoded, one encode per
hash per step, references held to the last occurrence and released at finish / abort /
preemption, LRU eviction only when space is needed, evictions sent to the runner."""

from __future__ import annotations

import pytest

from engine.config import ENCODER_CACHE_BUDGETS, CacheConfig, SchedulerConfig
from engine.outputs import ModelRunnerOutput
from engine.request import MultiModalFeature, PlaceholderRange, RequestStatus
from engine.scheduler import Scheduler
from tests.unit.fakes import make_request

IMG = 7   # placeholder token id


def feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, PlaceholderRange(offset, length))


def mm_request(req_id: str, items: list[tuple[str, int, int]], prompt_len: int, max_tokens: int = 2,
               prefix: int = 0):
    """A prompt of ``prompt_len`` tokens whose items (identifier, offset, length) are placeholder runs;
    the other tokens derive from ``prefix`` (equal prefixes share prefix-cache blocks)."""
    ids = [100 + prefix * 7 + i % 50 for i in range(prompt_len)]
    for _, offset, length in items:
        ids[offset:offset + length] = [IMG] * length
    return make_request(req_id, prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                        mm_features=[feature(*it) for it in items])


def make_sched(budget_tokens=64, encoder_budget=None, cache_size=None, max_item=8, num_blocks=64,
               block_size=4, prefix_caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget_tokens, max_num_seqs=16,
                                     max_num_encoder_input_tokens=encoder_budget, encoder_cache_size=cache_size),
                     CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
                     max_model_len=256, num_kv_blocks=num_blocks, max_embeds_per_mm_item=max_item)


def run_step(sched: Scheduler):
    """One schedule + update, sampling token 1 for every request whose prompt is done."""
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests[rid]
        sampled.append([1] if r.num_computed_tokens >= r.num_tokens else [])
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return so


def referenced(sched: Scheduler) -> dict[str, set[str]]:
    return {k: v for k, v in sched.encoder_cache_manager.cached.items() if v}


def test_budgets_are_in_embeddings_and_raised_to_the_largest_item():
    k = ENCODER_CACHE_BUDGETS
    assert SchedulerConfig(max_num_batched_tokens=16).encoder_budgets(576) == (576, k * 576)
    assert SchedulerConfig(max_num_batched_tokens=8192).encoder_budgets(576) == (8192, k * 8192)
    assert SchedulerConfig(max_num_encoder_input_tokens=100, encoder_cache_size=50).encoder_budgets(576) == (576, 576)
    assert SchedulerConfig(max_num_encoder_input_tokens=600, encoder_cache_size=2000).encoder_budgets(576) == (600, 2000)


def test_item_larger_than_the_budget_is_refused_at_admission():
    sched = make_sched(max_item=8)
    with pytest.raises(ValueError, match="exceeds the encoder budget"):
        sched.add_request(mm_request("big", [("h", 2, 80)], prompt_len=90))
    assert not sched.requests


def test_chunk_stops_before_an_item_over_the_step_budget():
    """Encoder budget 8 embeddings: a's item is encoded, b's chunk stops just before its item."""
    sched = make_sched(budget_tokens=64, encoder_budget=8, max_item=8)
    sched.add_request(mm_request("a", [("ha", 2, 8)], prompt_len=12))
    sched.add_request(mm_request("b", [("hb", 3, 8)], prompt_len=12, prefix=1))
    so = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 12, "b": 3}
    assert so.scheduled_encoder_inputs == {"a": (0,)}
    so = run_step(sched)
    assert so.scheduled_encoder_inputs == {"b": (0,)} and so.num_scheduled_tokens["b"] == 9


def test_same_image_in_many_requests_is_encoded_once_and_twice_in_one_prompt_keeps_its_reference():
    sched = make_sched(budget_tokens=64, max_item=8)
    sched.add_request(mm_request("a", [("h", 1, 4), ("h", 8, 4)], prompt_len=14))
    sched.add_request(mm_request("b", [("h", 2, 4)], prompt_len=8, prefix=1))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"a": (0,)}          # once, for both requests and both occurrences
    ecm = sched.encoder_cache_manager
    assert ecm.num_hits == 1 and ecm.num_queries == 2
    # Both prompts fit this step: every occurrence is consumed, the entry stays cached unreferenced.
    assert referenced(sched) == {} and "h" in ecm.cached


def test_reference_held_until_the_last_occurrence_is_computed():
    sched = make_sched(budget_tokens=6, max_item=4)
    sched.add_request(mm_request("a", [("h", 1, 4), ("h", 8, 4)], prompt_len=14))
    so = run_step(sched)      # tokens 0-5: first occurrence computed
    assert so.scheduled_encoder_inputs == {"a": (0,)} and referenced(sched) == {"h": {"a"}}
    so = run_step(sched)      # tokens 6-11: the second occurrence reads the same entry
    assert so.scheduled_encoder_inputs == {} and referenced(sched) == {}
    assert "h" in sched.encoder_cache_manager.cached          # unreferenced, still cached


def test_unreferenced_entries_stay_cached_and_are_evicted_lru_only_when_needed():
    sched = make_sched(budget_tokens=64, encoder_budget=8, cache_size=8, max_item=4)
    for i, h in enumerate(["h1", "h2"]):
        sched.add_request(mm_request(f"r{i}", [(h, 1, 4)], prompt_len=6, max_tokens=1, prefix=i))
    so = run_step(sched)
    assert so.free_encoder_identifiers == () and set(sched.encoder_cache_manager.cached) == {"h1", "h2"}
    sched.add_request(mm_request("again", [("h1", 1, 4)], prompt_len=6, max_tokens=1, prefix=5))
    so = run_step(sched)
    assert so.scheduled_encoder_inputs == {} and so.free_encoder_identifiers == ()   # a hit
    sched.add_request(mm_request("new", [("h3", 1, 4)], prompt_len=6, max_tokens=1, prefix=6))
    so = run_step(sched)
    assert so.scheduled_encoder_inputs == {"new": (0,)}
    assert so.free_encoder_identifiers == ("h2",)              # least recently released, unreferenced


def test_no_space_in_a_full_cache_of_referenced_entries_waits_and_others_go_on():
    """Cache of 4 held by a running request whose image is not consumed yet: a second image
    request waits before its placeholder; a text request goes on."""
    sched = make_sched(budget_tokens=4, cache_size=4, max_item=4, num_blocks=64)
    sched.add_request(mm_request("a", [("ha", 2, 4)], prompt_len=10))
    so = run_step(sched)                       # a: tokens 0-3, its image encoded, still referenced
    assert so.num_scheduled_tokens == {"a": 4}
    sched.add_request(mm_request("b", [("hb", 0, 4)], prompt_len=6, prefix=1))
    sched.add_request(make_request("text", prompt_len=3, max_tokens=1))
    so = sched.schedule()
    assert "b" not in so.num_scheduled_tokens and so.num_scheduled_tokens.get("a") == 4


def test_prefix_hit_into_an_evicted_image_schedules_zero_tokens_and_others_go_on():
    """A prefix-cache hit covers half of an image whose encoder output is gone and cannot be
    re-encoded this step (budget used by another request): the request schedules nothing, the
    request behind it runs."""
    sched = make_sched(budget_tokens=64, encoder_budget=8, cache_size=8, max_item=8, block_size=4)
    sched.add_request(mm_request("first", [("h", 6, 8)], prompt_len=16, max_tokens=1))
    run_step(sched)
    run_step(sched)
    assert not sched.requests
    sched.encoder_cache_manager.evict_unreferenced()
    sched.add_request(mm_request("other", [("x", 0, 8)], prompt_len=9, max_tokens=1, prefix=3))
    sched.add_request(mm_request("same", [("h", 6, 8)], prompt_len=16, max_tokens=1))
    sched.add_request(make_request("text", prompt_len=3, max_tokens=1))
    so = sched.schedule()
    assert "same" not in so.num_scheduled_tokens              # its hit (12 tokens) reaches into the image
    assert so.num_scheduled_tokens["text"] == 3 and so.scheduled_encoder_inputs == {"other": (0,)}
    assert sched.requests["same"].status == RequestStatus.WAITING


def test_references_released_on_abort_and_preemption():
    sched = make_sched(budget_tokens=64, max_item=4, num_blocks=7, block_size=4)
    sched.add_request(mm_request("a", [("ha", 0, 4)], prompt_len=8, max_tokens=8))
    sched.add_request(mm_request("b", [("hb", 0, 4)], prompt_len=8, max_tokens=8, prefix=1))
    so = run_step(sched)
    assert set(so.scheduled_encoder_inputs) == {"a", "b"}
    # Images consumed already: decode until the KV cache runs out and b is preempted.
    while sched.num_preemptions == 0:
        run_step(sched)
    assert referenced(sched) == {}
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    assert referenced(sched) == {} and sched.encoder_cache_manager.num_freeable_slots == \
        sched.encoder_cache_manager.cache_size


def test_abort_mid_image_releases_the_reference():
    sched = make_sched(budget_tokens=3, max_item=8)
    sched.add_request(mm_request("a", [("h", 1, 8)], prompt_len=12))
    run_step(sched)
    assert referenced(sched) == {"h": {"a"}}
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert referenced(sched) == {}
    assert sched.encoder_cache_manager.num_freeable_slots == sched.encoder_cache_manager.cache_size


def test_prefix_cache_keys_carry_the_image_hash():
    sched = make_sched(budget_tokens=64, max_item=4)
    sched.add_request(mm_request("a", [("h1", 4, 4)], prompt_len=16, max_tokens=1))
    run_step(sched)
    run_step(sched)
    for name, h, hit in [("same", "h1", 12), ("other", "h2", 4)]:
        sched.add_request(mm_request(name, [(h, 4, 4)], prompt_len=16, max_tokens=1))
        so = sched.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == hit, name
        sched.finish_requests(name, RequestStatus.FINISHED_ABORTED)
