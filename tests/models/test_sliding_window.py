"""Sliding-window attention against transformers on tiny random checkpoints (CPU, float32: greedy tokens
equal, logprobs within 1e-3), with prompts and generations well past the window:

- Mistral (every layer within ``sliding_window`` 12; 5 query heads over 1 KV head) and Mixtral
  (window 10, 3 query heads over 1 KV head): the KV blocks before a running request's window go back to the
  pool, counted while a long request decodes;
- Gemma 3 (window 10 on its sliding layers, global layers beside them; 3 query heads over 1 KV head), and
  Qwen2 / Qwen3 with ``use_sliding_window`` (window 11 / 12 on the layers from ``max_window_layers`` on): the
  sliding and global layers are separate KV cache groups, the sliding ones return the blocks before their
  window, the global ones keep every block;
- Qwen3-MoE with ``use_sliding_window`` (window 10 on every layer: transformers' Qwen3-MoE has no
  ``max_window_layers``) and Qwen3 with ``max_window_layers`` 0: blocks go back to the pool as Mistral's;
- chunked prefill (chunks shorter and longer than the window, at odd offsets), prefix caching of a prompt
  whose head blocks were returned, preemption (recompute) across the window (Mistral, Gemma 3, Qwen2,
  Qwen3), and admission by what a request still needs (a prompt longer than the whole KV cache runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.models.utils import check_outputs_close, hf_float32, hf_greedy

MAX_TOKENS = 24
MISTRAL_WINDOW, MIXTRAL_WINDOW, GEMMA_WINDOW = 12, 10, 10
QWEN2_WINDOW, QWEN3_WINDOW, QWEN3_MOE_WINDOW = 11, 12, 10
WINDOWS = {"mistral": [MISTRAL_WINDOW] * 2, "mixtral": [MIXTRAL_WINDOW] * 2,
           "gemma3": [GEMMA_WINDOW, None, GEMMA_WINDOW],
           "gemma3_6": [GEMMA_WINDOW, GEMMA_WINDOW, None, GEMMA_WINDOW, GEMMA_WINDOW, None],
           "qwen2": [None, QWEN2_WINDOW, QWEN2_WINDOW],
           "qwen2_uneven": [None, None] + [QWEN2_WINDOW] * 3,
           "qwen3": [None, None, QWEN3_WINDOW], "qwen3_every": [QWEN3_WINDOW] * 2,
           "qwen3_moe": [QWEN3_MOE_WINDOW] * 3}
"""Each family's per-layer window (None: the whole context), as transformers applies them."""
LONG_PROMPT = " ".join(TINY_PROMPTS) + " " + " ".join(TINY_PROMPTS[::-1])


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-sliding")
    return {
        "mistral": build_tiny_checkpoint(root / "mistral", "mistral", seed=21, hidden_size=80,
                                         num_attention_heads=5, num_key_value_heads=1, head_dim=16,
                                         sliding_window=MISTRAL_WINDOW),
        "mixtral": build_tiny_checkpoint(root / "mixtral", "mixtral", seed=22, hidden_size=48,
                                         num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                         intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=MIXTRAL_WINDOW),
        "gemma3": build_tiny_checkpoint(root / "gemma3", "gemma3_text", seed=23, hidden_size=48,
                                        num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                        num_hidden_layers=3, sliding_window_pattern=2, query_pre_attn_scalar=20,
                                        sliding_window=GEMMA_WINDOW),
        "gemma3_6": build_tiny_checkpoint(root / "gemma3_6", "gemma3_text", seed=28, hidden_size=48,
                                          num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                          num_hidden_layers=6, sliding_window_pattern=3, query_pre_attn_scalar=20,
                                          sliding_window=GEMMA_WINDOW),
        "qwen2": build_tiny_checkpoint(root / "qwen2", "qwen2", seed=24, hidden_size=48, num_attention_heads=3,
                                       num_key_value_heads=1, num_hidden_layers=3, use_sliding_window=True,
                                       sliding_window=QWEN2_WINDOW, max_window_layers=1),
        "qwen2_uneven": build_tiny_checkpoint(root / "qwen2_uneven", "qwen2", seed=29, hidden_size=48,
                                              num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=5,
                                              use_sliding_window=True, sliding_window=QWEN2_WINDOW,
                                              max_window_layers=2),
        "qwen3": build_tiny_checkpoint(root / "qwen3", "qwen3", seed=25, hidden_size=48, num_attention_heads=3,
                                       num_key_value_heads=1, head_dim=16, num_hidden_layers=3,
                                       use_sliding_window=True, sliding_window=QWEN3_WINDOW, max_window_layers=2),
        "qwen3_every": build_tiny_checkpoint(root / "qwen3_every", "qwen3", seed=26, hidden_size=48,
                                             num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                             use_sliding_window=True, sliding_window=QWEN3_WINDOW,
                                             max_window_layers=0),
        "qwen3_moe": build_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=27, hidden_size=48,
                                           num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                           num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                           use_sliding_window=True, sliding_window=QWEN3_MOE_WINDOW,
                                           max_window_layers=1),
    }


def _prompts(tok) -> list[list[int]]:
    """Token ids of prompts from 1x to 6x the window, the shortest within it."""
    ids = [tok.encode(p) for p in TINY_PROMPTS[:3]] + [tok.encode(LONG_PROMPT)]
    assert min(map(len, ids)) < MIXTRAL_WINDOW and max(map(len, ids)) > 6 * MISTRAL_WINDOW
    return ids


@pytest.mark.parametrize("family", list(WINDOWS))
def test_parity_with_transformers_past_the_window(dirs, family):
    d = dirs[family]
    hf = hf_float32(d)
    llm = LLM(str(d), seed=0, block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    layers = llm.llm_engine.core.runner.model.attention_layers()
    windows = [a.sliding_window for a in layers]
    assert layers[0].backend.cpu_decode is not None           # windowed decodes through the C kernel
    expected = WINDOWS[family]
    assert windows == expected
    if family.startswith("qwen"):                             # transformers' own layers say the same
        assert [layer.self_attn.sliding_window for layer in hf.model.layers] == expected
    every = expected[0] if all(w == expected[0] for w in expected) else None
    assert llm.llm_engine.core.scheduler.kv_cache_manager.sliding_window == every
    assert llm.llm_engine.core.scheduler.max_model_len > 4 * MISTRAL_WINDOW     # not capped to the window
    ids = _prompts(llm.get_tokenizer())
    refs = [hf_greedy(hf, i, MAX_TOKENS) for i in ids]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], _params(), use_tqdm=False)
    exact = check_outputs_close(outputs, refs, [f"{family} prompt {i}" for i in range(len(refs))])
    assert exact == len(refs)


# Qwen3's two global layers are two KV cache groups of one layer (and its sliding layer a third): its blocks are
# a third of a layer-wide block, and both global groups hold every token.
@pytest.mark.parametrize("family,num_blocks", [("mistral", 120), ("mistral", 40), ("gemma3", 120), ("gemma3_6", 120),
                                               ("qwen2", 120), ("qwen2_uneven", 160), ("qwen3", 240), ("qwen3_every", 40), ("qwen3_moe", 40)])
def test_chunked_prefill_and_prefix_caching(dirs, family, num_blocks):
    """Chunks of 7 tokens (shorter than the window, at every offset in a block); a second prompt sharing the
    long prefix hits the cache (for Mistral, blocks the first request returned while it ran; with 40 blocks
    the head of the prefix is reused by then, and the hit takes only the last window's blocks). Equal to
    transformers."""
    d = dirs[family]
    hf = hf_float32(d)
    llm = LLM(str(d), seed=0, block_size=4, max_num_batched_tokens=7, max_num_seqs=3, enable_prefix_caching=True,
              num_gpu_blocks_override=num_blocks)
    tok = llm.get_tokenizer()
    long_ids = tok.encode(LONG_PROMPT)
    prompts = [long_ids, long_ids + tok.encode(" The quick brown fox")]
    refs = [hf_greedy(hf, i, MAX_TOKENS) for i in prompts]
    first = llm.generate([{"prompt_token_ids": prompts[0]}], _params(), use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": prompts[1]}], _params(), use_tqdm=False)
    assert check_outputs_close(first + second, refs, ["long", "long + tail (cached prefix)"]) == len(refs)
    assert second[0].num_cached_tokens >= 4 * (len(long_ids) // 4 - 1)


@pytest.mark.parametrize("family,num_blocks", [("mistral", 8), ("gemma3", 104), ("gemma3_6", 104),
                                               ("qwen3_every", 8), ("qwen2", 112)])
def test_preemption_across_the_window(dirs, family, num_blocks):
    """A KV cache too small for three requests past their window at once: some are preempted and recomputed
    (chunked, 7 tokens a step). Equal to transformers."""
    d = dirs[family]
    hf = hf_float32(d)
    llm = LLM(str(d), seed=0, block_size=4, max_num_batched_tokens=7, max_num_seqs=3, enable_prefix_caching=False,
              num_gpu_blocks_override=num_blocks)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(LONG_PROMPT), tok.encode(TINY_PROMPTS[1]) * 3, tok.encode(TINY_PROMPTS[2]) * 4]
    refs = [hf_greedy(hf, i, MAX_TOKENS) for i in prompts]
    outputs = llm.generate([{"prompt_token_ids": i} for i in prompts], _params(), use_tqdm=False)
    assert check_outputs_close(outputs, refs, ["long", "repeated 3", "repeated 4"]) == len(refs)
    assert llm.llm_engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("family", ["mistral", "qwen3_every", "qwen3_moe"])
def test_blocks_out_of_the_window_are_freed_while_decoding(dirs, family):
    """A request decoding far past its window, every layer windowed (Mistral; Qwen3 with max_window_layers 0;
    Qwen3-MoE), holds at most a window and a chunk of blocks: the free blocks in the pool stay high while it
    runs, and a prompt longer than the whole cache is admitted."""
    d, window = dirs[family], WINDOWS[family][0]
    block_size, num_blocks = 4, 12                 # 11 usable blocks: 44 tokens, less than the prompt
    llm = LLM(str(d), seed=0, block_size=block_size, max_num_batched_tokens=8, max_num_seqs=2,
              num_gpu_blocks_override=num_blocks, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    ids = tok.encode(LONG_PROMPT)
    assert len(ids) > (num_blocks - 1) * block_size
    core = llm.llm_engine.core
    kv = core.scheduler.kv_cache_manager
    # Admission: what the request still needs at its peak (a window and a chunk), not its whole length.
    peak = -(-(window - 1 + 8) // block_size) + 1
    assert kv.can_fit_ever(len(ids) + 64) and peak < num_blocks - 1
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=64,
                                                                      ignore_eos=True))
    held, free, returned = [], [], []
    while engine.has_unfinished_requests():
        # The step's chunk starts at ``start``: every block before its first query's window is back in the pool.
        start = core.scheduler.requests["r"].num_computed_tokens if "r" in core.scheduler.requests else 0
        engine.step()
        if "r" in kv.req_to_blocks:
            blocks = kv.req_to_blocks["r"]
            held.append(sum(1 for b in blocks if not b.is_null))
            returned.append(sum(1 for b in blocks if b.is_null))
            free.append(kv.num_free_blocks)
            assert returned[-1] == max(0, start - window + 1) // block_size
    assert max(held) <= peak
    assert min(free) >= (num_blocks - 1) - peak
    assert returned[-1] >= (len(ids) + 64 - window) // block_size - 1
    assert kv.num_free_blocks == num_blocks - 1            # all back at the end
    assert core.scheduler.num_preemptions == 0
    # And the output is transformers'.
    ref = hf_greedy(hf_float32(d), ids, 64)
    out = LLM(str(d), seed=0, block_size=block_size, max_num_batched_tokens=8, num_gpu_blocks_override=num_blocks,
              enable_prefix_caching=False).generate([{"prompt_token_ids": ids}], _params(64), use_tqdm=False)
    assert check_outputs_close(out, [ref], ["long decode in a small cache"]) == 1


@pytest.mark.parametrize("family,group_size", [("gemma3", 1), ("gemma3_6", 2), ("qwen2", 1), ("qwen2_uneven", 2),
                                              ("qwen3", 1)])
def test_sliding_groups_return_blocks_global_groups_keep_them(dirs, family, group_size):
    """Sliding and global layers are KV cache groups of ``group_size`` layers (``engine.kv_cache_groups``: the
    6-layer Gemma 3's 4 sliding layers are 2 groups, its 2 global ones 1; the 5-layer Qwen2's 3 sliding layers
    are 2 groups, the second with one slot unused) over one pool: while a long request
    runs, each sliding group's blocks before the chunk's window are back in the pool (the null block in their
    places), each global group holds every block, and the pool's free count is the rest. Layers of the same
    slot share their K and V tensors; each reads its group's block table."""
    block_size = 4
    llm = LLM(str(dirs[family]), seed=0, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=1,
              enable_prefix_caching=False)
    engine, core = llm.llm_engine, llm.llm_engine.core
    kv = core.scheduler.kv_cache_manager
    groups = core.runner.kv_cache.groups
    layers = core.runner.model.attention_layers()
    windows = WINDOWS[family]
    assert groups.group_size == group_size
    assert groups.num_groups == sum(-(-windows.count(w) // group_size) for w in set(windows))
    assert [g.window for g in kv.groups] == list(groups.group_windows) and kv.sliding_window is None
    assert [a.kv_group for a in layers] == list(groups.layer_group)
    assert [groups.group_windows[a.kv_group] for a in layers] == windows
    for a, slot in zip(layers, groups.layer_slot):
        first = layers[groups.layer_slot.index(slot)]
        assert a.k_cache is first.k_cache and a.v_cache is first.v_cache
    assert len({id(a.k_cache) for a in layers}) == group_size
    ids = llm.get_tokenizer().encode(LONG_PROMPT)
    engine.add_request("g", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=4,
                                                                      ignore_eos=True))
    returned = {g.group: 0 for g in kv.groups}
    while engine.has_unfinished_requests():
        start = core.scheduler.requests["g"].num_computed_tokens if "g" in core.scheduler.requests else 0
        engine.step()
        if "g" not in kv.req_to_blocks:
            continue
        computed = core.scheduler.requests["g"].num_computed_tokens
        held = 0
        for g in kv.groups:
            blocks = g.req_to_blocks["g"]
            dead = 0 if g.window is None else max(0, start - g.window + 1) // block_size
            assert all(b.is_null for b in blocks[:dead]) and not any(b.is_null for b in blocks[dead:])
            assert len(blocks) * block_size >= computed
            held += len(blocks) - dead
            returned[g.group] = dead
        assert kv.num_free_blocks == kv.num_usable_blocks - held
    for g in kv.groups:
        if g.window is None:
            assert returned[g.group] == 0
        else:
            assert returned[g.group] >= (len(ids) - g.window) // block_size - 4
    assert kv.num_free_blocks == kv.num_usable_blocks                  # all back at the end


def test_qwen_layer_windows_follow_transformers_configs():
    """``use_sliding_window`` false: no window (transformers drops ``sliding_window``); Qwen2 / Qwen3 slide from
    ``max_window_layers`` on or by explicit ``layer_types``; Qwen3-MoE slides everywhere."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    from engine.models.sliding_window import FULL, SLIDING, kv_free_window, layer_windows

    tiny = dict(num_hidden_layers=4, sliding_window=16)
    for cls in (Qwen2Config, Qwen3Config, Qwen3MoeConfig):
        off = cls(**tiny, use_sliding_window=False, max_window_layers=1)
        assert layer_windows(off) == [None] * 4 and kv_free_window(off) is None
    for cls in (Qwen2Config, Qwen3Config):
        assert layer_windows(cls(**tiny, use_sliding_window=True, max_window_layers=3)) == [None] * 3 + [16]
        explicit = cls(**tiny, use_sliding_window=True, layer_types=[SLIDING, FULL, SLIDING, FULL])
        assert layer_windows(explicit) == [16, None, 16, None] and kv_free_window(explicit) is None
        assert kv_free_window(cls(**tiny, use_sliding_window=True, max_window_layers=0)) == 16
    moe = Qwen3MoeConfig(**tiny, use_sliding_window=True, max_window_layers=2)
    assert layer_windows(moe) == [16] * 4 and kv_free_window(moe) == 16
