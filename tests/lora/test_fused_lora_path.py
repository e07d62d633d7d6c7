"""CHORUS_LORA_KERNEL in ``lora.layers``: the fused kernel (``kernels.lora_fused``) in place of the
shrink + expand pair, on CPU through the Triton interpreter.

Layer level: the choice (and CHORUS_LORA_FUSED_CONFIG) is read once when a layer is built, "fused"
and "auto" give the split path's result, and each step runs the kernels the choice names. Model
level: the engine with the Triton LoRA backend forced on CPU and CHORUS_LORA_KERNEL=fused matches
transformers + PEFT greedy, with adapters of two ranks and target sets next to the base model.
"""

from __future__ import annotations

from unittest.mock import Mock

import pytest
import torch

import kernels.lora_expand_silu_mul as lora_expand_silu_mul
import kernels.lora_fused as lora_fused
import kernels.lora_shrink as lora_shrink
from engine import LLM, SamplingParams
from lora import LoRARequest
from lora.batch import build_lora_batch
from tests.lora.test_layers import IN, MAX_LORAS, _adapters, _layer, _load, _manual
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.utils import check_logprobs_close, ours_as_ref


class KernelCalls:
    """Counts calls of the fused kernel and of the split pair's shrink (``lora.layers`` imports them
    at call time, so spies on the module attributes see every launch)."""

    def __init__(self, monkeypatch) -> None:
        self.fused_spy = Mock(wraps=lora_fused.lora_shrink_expand)
        self.split_spy = Mock(wraps=lora_shrink.lora_shrink)
        monkeypatch.setattr(lora_fused, "lora_shrink_expand", self.fused_spy)
        monkeypatch.setattr(lora_shrink, "lora_shrink", self.split_spy)

    def counts(self) -> tuple[int, int]:
        """(fused calls, split calls) so far."""
        return self.fused_spy.call_count, self.split_spy.call_count


def _run_layer(token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's output, the hand-written reference) for one step (slots built under the current env)."""
    base, slots, state = _layer("triton")
    adapters = _adapters()
    _load(slots, adapters)
    x = torch.randn(len(token_slots), IN, generator=torch.Generator().manual_seed(len(token_slots)))
    base_y = torch.nn.functional.linear(x, base.weight)
    state.batch = build_lora_batch(torch.tensor(token_slots, dtype=torch.int32), MAX_LORAS,
                                   with_segments=False)
    return base(x), _manual(x, base_y, token_slots, adapters)


SHORT, LONG = [0, 2, -1, 2], [0, 2, -1, 2, 0, 0, -1, 2, 1]
"""Steps of 4 and 9 tokens (base rows, a slot without weights); FUSED_MAX_TOKENS is set to 4 below."""


@pytest.mark.parametrize("kernel,short_fused,long_fused", [("split", False, False), ("fused", True, True),
                                                            ("auto", True, False)])
def test_kernel_choice_matches_split(kernel, short_fused, long_fused, monkeypatch):
    """Each choice runs the kernels it names (auto: fused up to FUSED_MAX_TOKENS tokens) and every
    result equals the hand-written update."""
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 4)
    if kernel != "split":
        monkeypatch.setenv("CHORUS_LORA_KERNEL", kernel)
    calls = KernelCalls(monkeypatch)
    for token_slots, fused in ((SHORT, short_fused), (LONG, long_fused)):
        fused0, split0 = calls.counts()
        y, want = _run_layer(token_slots)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        assert calls.counts() == (fused0 + fused, split0 + (not fused)), token_slots


def test_choice_and_fused_config_read_once_per_layer(monkeypatch):
    monkeypatch.setenv("CHORUS_LORA_KERNEL", "fused")
    monkeypatch.setenv("CHORUS_LORA_FUSED_CONFIG", "block_k=16,n_tiles=1")
    base, slots, state = _layer("triton")
    assert slots.overrides.kernel == "fused"
    assert slots.overrides.fused == (("block_k", 16), ("n_tiles", 1))
    _, torch_slots, _ = _layer("torch")
    assert torch_slots.overrides.kernel == "split"                         # the torch path reads nothing
    adapters = _adapters()
    _load(slots, adapters)
    # Read at construction only: a later bad value does not reach the built layer.
    monkeypatch.setenv("CHORUS_LORA_KERNEL", "bogus")
    calls = KernelCalls(monkeypatch)
    x = torch.randn(len(LONG), IN)
    base_y = torch.nn.functional.linear(x, base.weight)
    state.batch = build_lora_batch(torch.tensor(LONG, dtype=torch.int32), MAX_LORAS, with_segments=False)
    torch.testing.assert_close(base(x), _manual(x, base_y, LONG, adapters), rtol=1e-4, atol=1e-4)
    assert calls.counts() == (1, 0)
    with pytest.raises(ValueError, match="CHORUS_LORA_KERNEL='bogus': use split, fused or auto"):
        _layer("triton")
    monkeypatch.setenv("CHORUS_LORA_KERNEL", "auto")
    monkeypatch.setenv("CHORUS_LORA_FUSED_CONFIG", "split_k=2")
    with pytest.raises(ValueError, match="LoRAFusedConfig override"):
        _layer("triton")


# ----------------------------------------------------------------------------------------
# The engine with the fused kernel vs transformers + PEFT
# ----------------------------------------------------------------------------------------
class LaunchSpy:
    """Stands in for a Triton kernel: counts its launches (``kernel[grid](...)``) and runs them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


MAX_TOKENS = 8
ADAPTERS = {   # name -> (r, alpha, target_modules): rank 4 below the slots' 16; q/v only leaves k zero
    "r4-all": (4, 8, ALL_TARGETS),
    "r8-qv": (8, 32, ["q_proj", "v_proj"]),
}
PLAN = [(0, "r4-all"), (2, "r8-qv"), (3, "r4-all"), (1, None)]
"""(prompt index, adapter) per request: r4-all has two requests, so decode segments of two tokens."""


@pytest.mark.parametrize("kernel", ["fused", "split", "split-tiles", "stacked"])
def test_triton_lora_path_in_the_model_matches_peft(kernel, tiny_llama_dir, tiny_prompts, tmp_path, monkeypatch):
    """The Triton backend forced on CPU: prefill and decode steps through ``lora_shrink_expand`` only
    ("fused"), through the split pair with the default overlap's begin / finish ("split"; with
    the o/down updates inside add + RMSNorm through its segment-tile programs at every size, as
    large steps take them, "split-tiles"), or with decode steps (<= 4
    tokens) through the stacked GEMM (the shrink inside the base GEMM, "stacked") and prefill
    through the split pair."""
    from transformers import AutoTokenizer

    from lora.manager import LoRAManager

    paths = {name: build_peft_adapter(tiny_llama_dir, tmp_path / name, r=r, lora_alpha=alpha,
                                      target_modules=t, seed=i + 1)
             for i, (name, (r, alpha, t)) in enumerate(ADAPTERS.items())}
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    pm = peft_reference_model(tiny_llama_dir, paths)
    refs = [peft_greedy(pm, a, tok.encode(tiny_prompts[p]), MAX_TOKENS) for p, a in PLAN]

    init = LoRAManager.__init__

    def triton_backend(self, *args, backend=None, **kwargs):
        init(self, *args, backend="triton", **kwargs)
    monkeypatch.setattr(LoRAManager, "__init__", triton_backend)
    tiles = kernel == "split-tiles"
    kernel = "split" if tiles else kernel
    monkeypatch.setenv("CHORUS_LORA_KERNEL", "split" if kernel == "stacked" else kernel)   # read when built
    monkeypatch.setenv("CHORUS_LORA_STACKED_MAX_TOKENS", str(len(PLAN) if kernel == "stacked" else 0))
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
    monkeypatch.delenv("CHORUS_LORA_OVERLAP", raising=False)
    calls = KernelCalls(monkeypatch)
    silu_mul_spy = Mock(wraps=lora_expand_silu_mul.lora_expand_silu_mul)
    monkeypatch.setattr(lora_expand_silu_mul, "lora_expand_silu_mul", silu_mul_spy)
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16,
              enable_prefix_caching=False)
    manager = llm.llm_engine.lora_manager
    assert manager.backend == "triton"
    assert {layer.overrides.kernel for layer in manager.layers.values()} == {
        "split" if kernel == "stacked" else kernel}
    reqs = [None if a is None else LoRARequest(a, list(ADAPTERS).index(a) + 1, str(paths[a]))
            for _, a in PLAN]
    outs = llm.generate([tiny_prompts[p] for p, _ in PLAN],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5),
                        lora_request=reqs, use_tqdm=False)
    for (p, a), ref, out in zip(PLAN, refs, outs):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"{a} / prompt {p}")
    fused, split = calls.counts()
    num_layers = len(manager.layers)
    num_mlps = sum(name.endswith("gate_up_proj") for name in manager.layers)
    if kernel == "stacked":
        # Decode steps take the stacked GEMM in every layer (gate/up's update still inside
        # SiLU-and-mul); the prefill step (more tokens) runs the shrink kernel.
        assert fused == 0 and stacked_spy.call_count == (MAX_TOKENS - 1) * num_layers
        assert split == num_layers and silu_mul_spy.call_count == MAX_TOKENS * num_mlps
    else:
        assert stacked_spy.call_count == 0
        used, unused = (fused, split) if kernel == "fused" else (split, fused)
        assert unused == 0 and used >= MAX_TOKENS * num_layers   # every step, layer
        # The split path adds the gate/up update inside SiLU-and-mul (CHORUS_LORA_FUSE_SILU_MUL's default).
        assert (silu_mul_spy.call_count >= MAX_TOKENS * num_mlps) if kernel == "split" else silu_mul_spy.call_count == 0
    if kernel in ("split", "stacked"):
        # The o_proj and down_proj updates ride in the add + RMSNorm after them
        # (CHORUS_LORA_FUSE_NORM's default), every step.
        assert norm_spy.call_count == 2 * MAX_TOKENS * num_mlps
    if tiles:   # every norm launch took the segment tiles (the q/k/v update: CUDA only, the rotary
        # + KV write is fused there; GPU tests)
        assert tile_spy.launches == norm_spy.call_count
    base = peft_greedy(pm, None, tok.encode(tiny_prompts[PLAN[0][0]]), 1)
    assert base.logprobs[0] != refs[0].logprobs[0]                       # the adapter changes the output
