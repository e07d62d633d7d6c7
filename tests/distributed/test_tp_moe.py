"""MoE models at tensor_parallel_size 2 (gloo, 2 processes, float32): attention heads split, every expert's
intermediate rows split, routers replicated. Mixtral (per-expert checkpoint tensors), Qwen3-MoE (a dense layer
among the sparse ones, transformers-5 stacked expert tensors) and Qwen2-MoE (q/k/v bias, a shared expert whose
rows split like a dense MLP's, its gate replicated) give the tokens of size 1 and logprobs within 1e-3,
with base-model requests and two adapters on the experts and routers (their B rows of gate/up and A columns of
down split with the experts) in one batch."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from lora.request import LoRARequest
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.models.utils import check_logprobs_close, ours_as_ref

MAX_TOKENS = 6
PROMPTS = TINY_PROMPTS[:4]
ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=96,
                 enable_lora=True, max_loras=2, max_lora_rank=8, seed=0)
EXPERTS_AND_ROUTER = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
VARIANTS = {   # name -> (transformers model_type, config overrides, save the per-expert (v4) layout)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    "qwen3moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                   norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen2moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, num_hidden_layers=2)),
}


def _run(model_dir, adapters: dict, tp: int) -> list:
    """Every prompt under the base model and each adapter, in one generate call: the completions."""
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **ENGINE_KW)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
        names = [None, *adapters]
        loras = [None if n is None else LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(names)]
        outputs = llm.generate([p for _ in names for p in PROMPTS], params, use_tqdm=False,
                               lora_request=[r for r in loras for _ in PROMPTS])
        return [o.outputs[0] for o in outputs]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_equals_tp1_with_expert_adapters(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    d = build_tiny_checkpoint(tmp_path / "model", arch, seed=3, **overrides)
    adapters = {
        "experts": build_peft_adapter(d, tmp_path / "experts", r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                      target_parameters=EXPERTS_AND_ROUTER, seed=1),
        "all": build_peft_adapter(d, tmp_path / "all", r=4, lora_alpha=16, seed=2, use_rslora=True,
                                  target_modules=ALL_TARGETS if arch != "mixtral" else ["k_proj", "v_proj"],
                                  target_parameters=EXPERTS_AND_ROUTER[:2] if arch == "mixtral" else []),
    }
    ref, ours = _run(d, adapters, tp=1), _run(d, adapters, tp=2)
    assert len(ours) == 3 * len(PROMPTS)
    for i, (a, b) in enumerate(zip(ref, ours)):
        assert list(a.token_ids) == list(b.token_ids), f"{variant} request {i}"
        assert check_logprobs_close(ours_as_ref(a), ours_as_ref(b), f"{variant} request {i}") == MAX_TOKENS
    base = ref[:len(PROMPTS)]
    for k in (1, 2):                       # each adapter changes the outputs: the comparison covers its shards
        with_adapter = ref[k * len(PROMPTS):(k + 1) * len(PROMPTS)]
        assert any(list(x.token_ids) != list(y.token_ids) for x, y in zip(base, with_adapter)), k


def test_experts_shard_and_load_their_rows():
    """Each rank of 2 holds its intermediate rows of every expert's gate and up and the same down columns,
    from per-expert and from stacked checkpoint tensors alike; an intermediate size the ranks do not divide
    is refused naming the setting."""
    import torch

    from engine.distributed.group import TensorParallelGroup
    from engine.layers.moe import FusedMoE

    E, H, I = 3, 8, 6
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    for rank in range(2):
        tp = TensorParallelGroup(rank=rank, size=2)
        stacked, per_expert = FusedMoE(E, 2, H, I, True, tp), FusedMoE(E, 2, H, I, True, tp)
        stacked.load_stacked("w13", gate_up)
        stacked.load_stacked("w2", down)
        for e in range(E):
            per_expert.load_expert("w13", e, 0, gate_up[e, :I])
            per_expert.load_expert("w13", e, 1, gate_up[e, I:])
            per_expert.load_expert("w2", e, 0, down[e])
        rows = slice(rank * 3, rank * 3 + 3)
        want13 = torch.cat([gate_up[:, :I][:, rows], gate_up[:, I:][:, rows]], dim=1)   # [E, 2 * 3, H]
        for m in (stacked, per_expert):
            assert m.intermediate_range == (rows.start, rows.stop) and m.intermediate_size == 3
            assert torch.equal(m.w13, want13) and torch.equal(m.w2, down[:, :, rows])
    with pytest.raises(ValueError, match="intermediate size 6 is not divisible by --tensor-parallel-size 4"):
        FusedMoE(E, 2, H, I, True, TensorParallelGroup(rank=0, size=4))
