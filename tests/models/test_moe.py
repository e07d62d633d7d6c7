"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against transformers on tiny random checkpoints (CPU, float32),
and the MoE block's pieces: routing, the sorted-by-expert reference, stacked weight loading, shared experts.

Parity is vLLM's rule (``tests.models.utils.check_logprobs_close``): greedy tokens equal, or where they part each
side's token is in the other's top-5; logprobs of the common prefix within 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers import moe
from tests.conftest import CORPUS, build_tiny_checkpoint
from tests.models.utils import check_logprobs_close, check_outputs_close, hf_float32, hf_greedy, ours_as_ref

MAX_TOKENS = 12
GPU_BF16_ATOL = 0.25
"""bfloat16 logprobs of our kernels against transformers' on the GPU (as tests/models/test_gpu_parity.py)."""

VARIANTS = {   # name -> (transformers model_type, config overrides)
    "mixtral-8x2": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
    "qwen3moe-8x2-norm": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                            norm_topk_prob=True, head_dim=32)),
    "qwen3moe-64x8": ("qwen3_moe", dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=32,
                                        norm_topk_prob=False, head_dim=32)),
    "qwen3moe-64x8-norm-dense1": ("qwen3_moe", dict(num_experts=64, num_experts_per_tok=8,
                                                    moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
                                                    num_hidden_layers=3, mlp_only_layers=[1])),
    # Qwen2-MoE: q/k/v bias, a gated shared expert beside 64 routed experts, a dense layer, no renormalization.
    "qwen2moe-64x8-shared-dense1": ("qwen2_moe", dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                      num_hidden_layers=3, mlp_only_layers=[1])),
    # Qwen2-MoE as llama.cpp's qwen2moe holds it: every layer sparse, no renormalization. Weights at half the
    # usual range: with 0.2 its q/k biases make attention so sharp that the int8 path's bfloat16 activations
    # (tests/models/test_gguf_families.py) move first-step logprobs by up to 0.84.
    "qwen2moe-8x2-shared": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                              shared_expert_intermediate_size=32, norm_topk_prob=False,
                                              initializer_range=0.1)),
    # Qwen2-MoE with its sliding window (layer 0 slides: even layers below max_window_layers), renormalized top-2.
    "qwen2moe-8x2-window": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                              shared_expert_intermediate_size=32, norm_topk_prob=True,
                                              use_sliding_window=True, sliding_window=8, max_window_layers=2)),
}
LONG_PROMPT = " ".join(CORPUS[:10])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Variant name -> its tiny checkpoint directory (built on first use)."""
    return checkpoint_getter(tmp_path_factory)


def checkpoint_getter(tmp_path_factory):
    """A function of a ``VARIANTS`` name that builds its tiny checkpoint on first use and returns its directory."""
    built = {}

    def get(name: str):
        if name not in built:
            arch, overrides = VARIANTS[name]
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, seed=3, **overrides)
        return built[name]
    return get



def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _check(outputs, refs, prompts, min_exact):
    assert [o.prompt for o in outputs] == prompts
    exact = check_outputs_close(outputs, refs, [f"prompt {i}" for i in range(len(refs))])
    assert exact >= min_exact, f"only {exact}/{len(refs)} prompts match transformers exactly"


# ------------------------------------------------------------------------------------------
# End to end against transformers
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_batch(variant, checkpoints, tiny_prompts, monkeypatch):
    """All prompts in one batch (several requests per step, each token routed to its own experts)."""
    from transformers import AutoTokenizer

    d = checkpoints(variant)
    hf, tok = hf_float32(d), AutoTokenizer.from_pretrained(d)
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in tiny_prompts]
    used = []    # distinct experts per multi-token call of the routed experts
    fused = moe.fused_moe

    def spy(hidden, w13, w2, topk_weights, topk_ids, fp8=None):
        if topk_ids.shape[0] > 1:
            used.append((topk_ids.unique().numel(), w13.shape[0]))
        return fused(hidden, w13, w2, topk_weights, topk_ids, fp8)
    monkeypatch.setattr(moe, "fused_moe", spy)
    llm = LLM(str(d), seed=0)
    outputs = llm.generate(tiny_prompts, _params(), use_tqdm=False)
    _check(outputs, refs, tiny_prompts, min_exact=6)
    assert llm.llm_engine.get_stats().max_reqs_per_step == len(tiny_prompts)
    assert used and max(n for n, _ in used) >= 0.75 * used[0][1]   # a step's tokens took most experts


@pytest.mark.parametrize("variant", ["mixtral-8x2", "qwen3moe-64x8-norm-dense1", "qwen2moe-8x2-window"])
def test_parity_chunked_prefill(variant, checkpoints, tiny_prompts):
    """A long prompt prefilled in chunks of a few tokens, beside short ones."""
    from transformers import AutoTokenizer

    d = checkpoints(variant)
    hf, tok = hf_float32(d), AutoTokenizer.from_pretrained(d)
    prompts = [LONG_PROMPT, tiny_prompts[0], tiny_prompts[3]]
    assert len(tok.encode(LONG_PROMPT)) > 100
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in prompts]
    llm = LLM(str(d), max_num_batched_tokens=16, max_num_seqs=2)
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    _check(outputs, refs, prompts, min_exact=2)


@pytest.mark.parametrize("variant", ["mixtral-8x2", "qwen3moe-64x8-norm-dense1"])
def test_lora_on_attention_matches_peft(variant, checkpoints, tiny_prompts, tmp_path):
    """A PEFT adapter on the attention projections gives PEFT's outputs (Qwen3-MoE: its q/k-norm attention)."""
    from transformers import AutoTokenizer

    from lora import LoRARequest
    from tests.lora.utils import build_peft_adapter, peft_greedy, peft_reference_model

    d = checkpoints(variant)
    # Attention only here: adapters on the experts and the router are tests/models/test_moe_lora.py's.
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = build_peft_adapter(d, tmp_path / "attn", r=8, lora_alpha=16, target_modules=targets, seed=5)
    tok = AutoTokenizer.from_pretrained(d)
    pm = peft_reference_model(d, {"attn": adapter})
    prompts = tiny_prompts[:3]
    refs = [peft_greedy(pm, "attn", tok.encode(p), MAX_TOKENS) for p in prompts]
    base = peft_greedy(pm, None, tok.encode(prompts[2]), MAX_TOKENS)
    assert base.token_ids != refs[2].token_ids          # the adapter changes the output
    llm = LLM(str(d), enable_lora=True, max_loras=1, max_lora_rank=8)
    request = LoRARequest("attn", 1, str(adapter))
    outputs = llm.generate(prompts, _params(), lora_request=request, use_tqdm=False)
    _check(outputs, refs, prompts, min_exact=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_bf16_follows_transformers(variant, checkpoints, tiny_prompts):
    """On CUDA in bfloat16 (the fused MoE kernels: sorted prefill, small-batch decode, CUDA graphs), each
    prompt four times so decode batches pass 16 rows: vLLM's top-5 rule against transformers in bfloat16 on
    the GPU, logprobs within ``GPU_BF16_ATOL``."""
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = checkpoints(variant)
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in tiny_prompts]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(d), device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, seed=0)
    outputs = llm.generate(tiny_prompts * 4, _params(), use_tqdm=False)
    for i, out in enumerate(outputs):
        check_logprobs_close(refs[i % len(refs)], ours_as_ref(out.outputs[0]), f"{variant} request {i}",
                             atol=GPU_BF16_ATOL)
    del llm
    gc.collect()


# ------------------------------------------------------------------------------------------
# Checkpoint formats and the model structure
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mixtral-8x2", "qwen3moe-64x8-norm-dense1", "qwen2moe-64x8-shared-dense1"])
def test_per_expert_and_stacked_checkpoints_load_the_same(variant, checkpoints):
    """HF's per-expert tensors (what ``save_pretrained`` writes by default) and transformers 5's stacked ones (its
    in-memory state dict, ``save_original_format=False``) fill the same stacked weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engine.models.registry import get_model_class

    d = checkpoints(variant)
    config = AutoConfig.from_pretrained(d)
    on_disk = load_file(str(d / "model.safetensors"))
    assert any(".experts.0." in n for n in on_disk)                 # per-expert names on disk
    stacked = hf_float32(d).state_dict()
    assert any(n.endswith(".experts.gate_up_proj") for n in stacked)
    models = []
    for weights in (on_disk, stacked):
        model = get_model_class(config)(config, 64)
        model.load_weights(weights.items())
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    for name, p in models[0].items():
        torch.testing.assert_close(p, models[1][name], rtol=0, atol=0, msg=name)
    experts = models[0]["model.layers.0.mlp.experts.w13"]
    hf_gate_up = stacked["model.layers.0.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(experts, hf_gate_up, rtol=0, atol=0)


def test_load_errors(checkpoints):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engine.models.qwen3_moe import Qwen3MoeForCausalLM

    d = checkpoints("qwen3moe-64x8-norm-dense1")
    config = AutoConfig.from_pretrained(d)
    weights = load_file(str(d / "model.safetensors"))
    lacking = {n: t for n, t in weights.items() if n != "model.layers.2.mlp.experts.63.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*model\.layers\.2\.mlp\.experts\.w13"):
        Qwen3MoeForCausalLM(config, 64).load_weights(lacking.items())
    stray = dict(weights, **{"model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match="not a sparse MoE layer"):
        Qwen3MoeForCausalLM(config, 64).load_weights(stray.items())
    wrong = dict(weights, **{"model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match=r"expert 3 w2 tensor has shape \(32, 64\), expected \(64, 32\)"):
        Qwen3MoeForCausalLM(config, 64).load_weights(wrong.items())


def test_sparse_layers_follow_the_config():
    """``decoder_sparse_step`` and ``mlp_only_layers`` pick the same sparse layers as transformers; the model's
    declared capabilities and activation width."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    from engine.layers.moe import SparseMoeBlock
    from engine.models.interfaces import ModelCapabilities
    from engine.models.mixtral import MixtralForCausalLM
    from engine.models.qwen3_moe import Qwen3MoeForCausalLM
    from engine.models.registry import get_model_class

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    config = Qwen3MoeConfig(**tiny, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            decoder_sparse_step=2, mlp_only_layers=[3])
    assert get_model_class(config) is Qwen3MoeForCausalLM                 # model_type fallback
    assert get_model_class(MixtralConfig(**tiny)) is MixtralForCausalLM
    hf = AutoModelForCausalLM.from_config(config)
    ours = Qwen3MoeForCausalLM(config, 64)
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert hf_sparse == [False, True, False, False, False, True]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == hf_sparse
    assert ours.shape.intermediate_size == max(48, 2 * 16, 2 * 32)
    assert (Qwen3MoeForCausalLM.capabilities == MixtralForCausalLM.capabilities
            == ModelCapabilities(tensor_parallel=True, weight_quantization=True))
    assert ours.lora_qkv_warmup_consumer() is None


def test_mixtral_layers_attend_within_the_sliding_window():
    """Contexts past the window are served (tests/models/test_sliding_window.py): every layer has the window."""
    from transformers import MixtralConfig

    from engine.models.mixtral import MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    model = MixtralForCausalLM(config, 64)
    assert [a.sliding_window for a in model.attention_layers()] == [32, 32]


# ------------------------------------------------------------------------------------------
# The MoE block's pieces
# ------------------------------------------------------------------------------------------
def _per_token_moe(hidden, w13, w2, topk_weights, topk_ids):
    """The plainest reference: every (token, expert) pair on its own, in float64."""
    hidden, w13, w2 = hidden.double(), w13.double(), w2.double()
    out = torch.zeros_like(hidden)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e] @ hidden[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e] @ act)
    return out


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (7, 8, 2), (33, 64, 8), (0, 4, 1)])
def test_fused_moe_ref_matches_per_token_loop(num_tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(num_tokens + num_experts)
    hidden_size, inter = 24, 40
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden_size, inter, generator=g) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, -1] = -1e4                                  # one expert nobody picks: an empty segment
    topk_weights, topk_ids = moe.select_experts(logits, top_k, renormalize=False)
    want = _per_token_moe(hidden, w13, w2, topk_weights, topk_ids).float()
    for fn in (moe.fused_moe_ref, moe.fused_moe):
        got = fn(hidden, w13, w2, topk_weights, topk_ids)
        assert got.shape == hidden.shape and got.dtype == hidden.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_select_experts_matches_transformers_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(17, 32)
    weight = torch.randn(16, 32)
    logits = torch.nn.functional.linear(x, weight)
    mixtral = MixtralConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=4)
    routers = [(MixtralTopKRouter(mixtral), True)]
    for norm in (True, False):
        config = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
        routers.append((Qwen3MoeTopKRouter(config), norm))
    for router, renormalize in routers:
        router.weight.data.copy_(weight)
        _, hf_weights, hf_ids = router(x)
        weights, ids = moe.select_experts(logits, 4, renormalize)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-6, atol=1e-6)
    # renormalized top-k softmax == the softmax over the top-k logits
    weights, ids = moe.select_experts(logits, 4, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), dim=-1))


def test_shared_expert_block_matches_qwen2_moe():
    """The shared expert (Qwen2-MoE's ``shared_expert`` + sigmoid ``shared_expert_gate``)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, norm_topk_prob=False)
    torch.manual_seed(0)
    hf = Qwen2MoeSparseMoeBlock(config)
    for p in hf.parameters():
        p.data.normal_(0, 0.3)
    ours = moe.SparseMoeBlock.from_config(config, 8, 16, renormalize=False)
    assert ours.activation_width() == max(2 * 16 + 24, 2 * 32)
    ours.gate.weight.data.copy_(hf.gate.weight)
    ours.experts.load_stacked("w13", hf.experts.gate_up_proj.data)
    ours.experts.load_stacked("w2", hf.experts.down_proj.data)
    ours.shared_expert.gate_up_proj.load_slice("weight", 0, hf.shared_expert.gate_proj.weight.data)
    ours.shared_expert.gate_up_proj.load_slice("weight", 1, hf.shared_expert.up_proj.weight.data)
    ours.shared_expert.down_proj.weight.data.copy_(hf.shared_expert.down_proj.weight)
    ours.shared_expert_gate.weight.data.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = hf(x).reshape(10, 32)
        got = ours(x.reshape(10, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
