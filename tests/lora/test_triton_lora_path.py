"""The Triton LoRA path in the engine, on CPU through the Triton interpreter: the engine with the
Triton LoRA backend forced on CPU matches transformers + PEFT greedy, with adapters of two ranks and
target sets next to the base model, through the split pair (shrink + expand), through the
stacked GEMM and through the split pair on a pool of rank rows (each adapter its own rank's pages),
and each step runs the kernels its path names.
"""

from __future__ import annotations

from unittest.mock import Mock

import pytest

import kernels.lora_expand_silu_mul as lora_expand_silu_mul
import kernels.lora_shrink as lora_shrink
from engine import LLM, SamplingParams
from lora import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, lora_row_bytes, peft_greedy, peft_reference_model
from tests.models.utils import check_logprobs_close, ours_as_ref


class LaunchSpy:
    """Stands in for a Triton kernel: counts its launches (``kernel[grid](...)``) and runs them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


MAX_TOKENS = 3
ADAPTERS = {   # name -> (r, alpha, target_modules): rank 4 below the slots' 16; q/v only leaves k zero
    "r4-all": (4, 8, ALL_TARGETS),
    "r8-qv": (8, 32, ["q_proj", "v_proj"]),
}
PLAN = [(0, "r4-all"), (2, "r8-qv"), (3, "r4-all"), (1, None)]
"""(prompt index, adapter) per request: r4-all has two requests, so decode segments of two tokens."""


@pytest.fixture(scope="module")
def peft_setup(tiny_llama_dir, tiny_prompts, tmp_path_factory):
    """(adapter name -> its directory, PEFT's greedy outputs per PLAN entry, PEFT's base-model output
    for PLAN's first prompt): shared by the kernel cases."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("triton-path-adapters")
    paths = {name: build_peft_adapter(tiny_llama_dir, root / name, r=r, lora_alpha=alpha,
                                      target_modules=t, seed=i + 1)
             for i, (name, (r, alpha, t)) in enumerate(ADAPTERS.items())}
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    pm = peft_reference_model(tiny_llama_dir, paths)
    refs = [peft_greedy(pm, a, tok.encode(tiny_prompts[p]), MAX_TOKENS) for p, a in PLAN]
    base = peft_greedy(pm, None, tok.encode(tiny_prompts[PLAN[0][0]]), 1)
    return paths, refs, base


@pytest.mark.parametrize("kernel", ["split", "stacked", "pooled-tiles"])
def test_triton_lora_path_in_the_model_matches_peft(kernel, peft_setup, tiny_llama_dir, tiny_prompts, monkeypatch):
    """The Triton backend forced on CPU: prefill and decode steps through the split pair with the
    default overlap's begin / finish ("split"), or with decode steps (<= 4 tokens) through the
    stacked GEMM (the shrink inside the base GEMM, "stacked") and prefill through the split pair;
    "pooled-tiles": the split pair with the slots in a pool of 16 rank rows
    (``--max-lora-pool-bytes``), where padded slots of rank 16 would take 32, and the o/down updates
    inside add + RMSNorm through its segment-tile programs at every size, as large steps take them."""
    from lora.manager import LoRAManager

    paths, refs, base = peft_setup

    init = LoRAManager.__init__

    def triton_backend(self, *args, backend=None, **kwargs):
        init(self, *args, backend="triton", **kwargs)
    monkeypatch.setattr(LoRAManager, "__init__", triton_backend)
    tiles = pooled = kernel == "pooled-tiles"
    kernel = "split" if pooled else kernel
    # The engine's policy (``ModelRunner.policy``, handed to the LoRA manager) with only the stacked
    # bound overridden: the overlap and the consumer fusions keep their defaults.
    stacked_max_tokens = len(PLAN) if kernel == "stacked" else 0
    monkeypatch.setenv("CHORUS_KERNEL_POLICY", f"lora_stacked_max_tokens={stacked_max_tokens}")
    import kernels.lora_expand as lora_expand
    stacked_spy = Mock(wraps=lora_expand.slotwise_buf)
    monkeypatch.setattr(lora_expand, "slotwise_buf", stacked_spy)
    import kernels.lora_expand_norm as lora_expand_norm
    norm_spy = Mock(wraps=lora_expand_norm.lora_expand_add_rms_norm)
    monkeypatch.setattr(lora_expand_norm, "lora_expand_add_rms_norm", norm_spy)
    tile_spy = LaunchSpy(lora_expand_norm._lora_expand_add_rms_norm_tile_kernel)
    if tiles:
        monkeypatch.setattr(lora_expand_norm, "PER_ROW_MAX_TOKENS", 0)
        monkeypatch.setattr(lora_expand_norm, "TILES_MIN_TOKENS", 1)
        monkeypatch.setattr(lora_expand_norm, "_lora_expand_add_rms_norm_kernel", None)   # must not run
        monkeypatch.setattr(lora_expand_norm, "_lora_expand_add_rms_norm_tile_kernel", tile_spy)
    shrink_spy = Mock(wraps=lora_shrink.lora_shrink)       # ``lora.layers`` imports it at call time
    monkeypatch.setattr(lora_shrink, "lora_shrink", shrink_spy)
    silu_mul_spy = Mock(wraps=lora_expand_silu_mul.lora_expand_silu_mul)
    monkeypatch.setattr(lora_expand_silu_mul, "lora_expand_silu_mul", silu_mul_spy)
    # float32 on CUDA too (its "auto" is bfloat16): the reference is PEFT in float32, to 1e-3. Eager, and the
    # spies reset after start-up: the counts below are per step (CUDA graph captures and the start-up
    # kernel warm-up call the kernels too, and graph replays call none).
    pool_bytes = 16 * lora_row_bytes(tiny_llama_dir) if pooled else None
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=16, enable_prefix_caching=False, max_lora_pool_bytes=pool_bytes)
    for spy in (stacked_spy, norm_spy, shrink_spy, silu_mul_spy):
        spy.reset_mock()
    tile_spy.launches = 0
    manager = llm.llm_engine.lora_manager
    assert manager.backend == "triton" and manager.policy is llm.llm_engine.runner.policy
    assert manager.policy.lora_stacked_max_tokens == stacked_max_tokens
    reqs = [None if a is None else LoRARequest(a, list(ADAPTERS).index(a) + 1, str(paths[a]))
            for _, a in PLAN]
    outs = llm.generate([tiny_prompts[p] for p, _ in PLAN],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5),
                        lora_request=reqs, use_tqdm=False)
    for (p, a), ref, out in zip(PLAN, refs, outs):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"{a} / prompt {p}")
    split = shrink_spy.call_count
    # The pool's A rows (3-d) or the padded slots (4-d), with the manager's page table either way.
    assert all(c.args[1].dim() == (3 if pooled else 4) and c.kwargs["pages"] is manager.state.pages
               for c in shrink_spy.call_args_list)
    if pooled:
        assert manager.pool_pages == 2 and manager.slot_nbytes() == pool_bytes
    num_layers = len(manager.layers)
    num_mlps = sum(name.endswith("gate_up_proj") for name in manager.layers)
    if kernel == "stacked":
        # Decode steps take the stacked GEMM in every layer (gate/up's update still inside
        # SiLU-and-mul); the prefill step (more tokens) runs the shrink kernel.
        assert stacked_spy.call_count == (MAX_TOKENS - 1) * num_layers
        assert split == num_layers and silu_mul_spy.call_count == MAX_TOKENS * num_mlps
    else:
        assert stacked_spy.call_count == 0 and split >= MAX_TOKENS * num_layers   # every step, layer
        # The split path adds the gate/up update inside SiLU-and-mul (``lora_fuse_silu_mul``'s default).
        assert silu_mul_spy.call_count >= MAX_TOKENS * num_mlps
    # The o_proj and down_proj updates ride in the add + RMSNorm after them (``lora_fuse_norm``'s
    # default), every step.
    assert norm_spy.call_count == 2 * MAX_TOKENS * num_mlps
    if tiles:   # every norm launch took the segment tiles (the q/k/v update: CUDA only, the rotary
        # + KV write is fused there; GPU tests)
        assert tile_spy.launches == norm_spy.call_count
    assert base.logprobs[0] != refs[0].logprobs[0]                       # the adapter changes the output
