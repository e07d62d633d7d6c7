"""Adapters of ranks 8, 16, 64 and 128 in one batch from a pool of rank rows (``--max-lora-pool-bytes``):
each request equal to PEFT and to itself alone; the pool holds what padded slots could not; a pool too
small for all of them evicts idle adapters by their pages; nothing is held afterwards."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from lora import LoRARequest
from lora.rank_pool import PAGE_ROWS
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, lora_row_bytes, peft_greedy, peft_reference_model
from tests.models.utils import check_logprobs_close, ours_as_ref

MAX_TOKENS = 16
ADAPTERS = {   # name -> (r, alpha, target_modules)
    "r8": (8, 16, ALL_TARGETS),
    "r16-qv": (16, 16, ["q_proj", "v_proj"]),
    "r64-mlp": (64, 32, ["gate_proj", "up_proj", "down_proj"]),
    "r128": (128, 64, ALL_TARGETS),
}
RANK_ROWS = sum(r for r, _, _ in ADAPTERS.values())
"""216 rank rows: all four adapters at once (each rank a multiple of PAGE_ROWS)."""


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tiny_prompts, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("mixed-rank-adapters")
    paths = {name: build_peft_adapter(tiny_llama_dir, root / name, r=r, lora_alpha=alpha, target_modules=t,
                                      seed=i + 11)
             for i, (name, (r, alpha, t)) in enumerate(ADAPTERS.items())}
    lora_reqs = {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())}
    names = list(ADAPTERS)
    plan = [(0, names[0]), (1, names[1]), (2, None), (3, names[2]), (4, names[3]), (0, names[3]), (2, names[1])]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    pm = peft_reference_model(tiny_llama_dir, paths)
    refs = [peft_greedy(pm, a, tok.encode(tiny_prompts[p]), MAX_TOKENS) for p, a in plan]
    return dict(dir=str(tiny_llama_dir), prompts=[tiny_prompts[p] for p, _ in plan],
                reqs=[None if a is None else lora_reqs[a] for _, a in plan], refs=refs)


def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _check_all(s, llm) -> list[list[int]]:
    outs = [o.outputs[0] for o in llm.generate(s["prompts"], _params(), lora_request=s["reqs"], use_tqdm=False)]
    for i, (out, ref) in enumerate(zip(outs, s["refs"])):
        check_logprobs_close(ref, ours_as_ref(out), name=f"request {i}")
    assert sum(o.token_ids == r.token_ids for o, r in zip(outs, s["refs"])) >= len(outs) - 1
    return [o.token_ids for o in outs]


def _nothing_held(llm) -> None:
    """No request holds a slot: the resident adapters are all idle (evictable)."""
    engine = llm.llm_engine
    slots = engine.scheduler.lora_slots
    assert not engine.has_unfinished_requests()
    assert all(slots.num_running(s) == 0 for s in range(slots.max_loras))
    assert sum(len(slots.pages_of(s)) for s in range(slots.max_loras)) == slots.pool.num_pages - slots.pool.num_free


def test_mixed_ranks_in_one_batch_match_peft_and_alone(setup):
    s = setup
    pool_bytes = RANK_ROWS * lora_row_bytes(s["dir"])
    llm = LLM(s["dir"], enable_lora=True, max_loras=4, max_lora_rank=128, max_lora_pool_bytes=pool_bytes,
              max_num_seqs=8)
    manager = llm.llm_engine.lora_manager
    assert manager.row_bytes == lora_row_bytes(s["dir"])
    assert manager.pool_pages * PAGE_ROWS == RANK_ROWS
    padded_bytes = 4 * 128 * manager.row_bytes              # four slots of rank 128
    assert manager.slot_nbytes() == pool_bytes < padded_bytes
    together = _check_all(s, llm)
    sched = llm.llm_engine.scheduler
    assert sched.lora_slots.num_evictions == 0 and sched.num_lora_reloads_while_running == 0
    # Every page was taken: the four adapters sat in the pool at once.
    assert sched.lora_slots.pool.num_free == 0 and sched.lora_slots.pool.used_bytes == pool_bytes
    for prompt, req, want in zip(s["prompts"], s["reqs"], together):
        alone = llm.generate(prompt, _params(), lora_request=req, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == want
    _nothing_held(llm)
    # Unloading frees the pages.
    for req in {r.lora_name: r for r in s["reqs"] if r is not None}.values():
        assert llm.llm_engine.remove_lora(req.lora_name)
    assert sched.lora_slots.pool.num_free == sched.lora_slots.pool.num_pages
    assert sched.lora_slots.num_resident == 0


def test_small_pool_evicts_idle_adapters_by_pages(setup):
    """A pool of 128 + 64 rows holds r128 and r64-mlp or the small ones, never all four: requests still
    answer as PEFT, adapters are evicted (several for one load) and none while it runs."""
    s = setup
    pool_bytes = (128 + 64) * lora_row_bytes(s["dir"])
    llm = LLM(s["dir"], enable_lora=True, max_loras=4, max_lora_rank=128, max_lora_pool_bytes=pool_bytes,
              max_num_seqs=8)
    _check_all(s, llm)
    sched = llm.llm_engine.scheduler
    assert sched.lora_slots.num_evictions >= 1
    assert sched.num_lora_reloads_while_running == 0
    _nothing_held(llm)


def test_pool_too_small_for_max_rank_is_refused(setup):
    with pytest.raises(ValueError, match="max-lora-pool-bytes to at least"):
        LLM(setup["dir"], enable_lora=True, max_loras=4, max_lora_rank=128, max_lora_pool_bytes=1000)


def test_tensor_parallel_pool_matches_peft(setup):
    """tensor_parallel_size 2 (gloo): each rank's pool holds its shards of the rows, the pages the scheduler
    names are the same on both, and the mixed batch still answers as PEFT."""
    s = setup
    llm = LLM(s["dir"], enable_lora=True, max_loras=4, max_lora_rank=128, tensor_parallel_size=2, device="cpu",
              max_lora_pool_bytes=RANK_ROWS * lora_row_bytes(s["dir"]), max_num_seqs=8)
    try:
        manager = llm.llm_engine.lora_manager
        assert manager.row_bytes < lora_row_bytes(s["dir"])           # this rank's shards only
        assert manager.pool_pages * PAGE_ROWS >= RANK_ROWS
        _check_all(s, llm)
        assert llm.llm_engine.scheduler.num_lora_reloads_while_running == 0
    finally:
        llm.llm_engine.core.shutdown()
