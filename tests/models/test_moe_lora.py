"""LoRA on MoE models' routed experts, shared experts and routers (Qwen3-MoE, Qwen2-MoE, Mixtral) against PEFT, on tiny random checkpoints
(CPU, float32): every adapter form PEFT 0.21 writes or reads for these models, several adapters and base-model
requests in one batch, each request equal to PEFT with its own adapter (greedy tokens; logprobs within 1e-3 by
vLLM's rule, ``tests.models.utils.check_logprobs_close``). An adapter whose expert shapes do not fit is a 400
that holds nothing.

The forms: PEFT's ``target_modules`` with the MLP names (on transformers 5 PEFT turns them into
``target_parameters`` on the stacked experts, one A for gate and up, ranks per ``rank_pattern``); explicit
``target_parameters`` with the router's ``gate.weight``; transformers 4's per-expert modules
(``block_sparse_moe.experts.N.w1`` ..., router ``gate``), which PEFT converts when it loads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from lora import LoRARequest
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_reference_model
from tests.models.test_moe import checkpoint_getter
from tests.models.utils import check_outputs_close

MAX_TOKENS = 12
ENGINE_KW = dict(enable_lora=True, max_loras=2, max_lora_rank=16, seed=0)
EXPERTS_AND_ROUTER = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``tests.models.test_moe``'s tiny MoE checkpoints, by variant name."""
    return checkpoint_getter(tmp_path_factory)


def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def per_expert_adapter(base_dir: Path, out_dir: Path, r: int, alpha: float, seed: int) -> Path:
    """A transformers-4-style adapter (random A and B) as PEFT saved them before transformers 5 stacked the
    experts: q_proj, the router ``gate`` and every expert's projections, Mixtral's ``block_sparse_moe.experts.N.w1``
    / ``w3`` / ``w2`` or Qwen-MoE's ``mlp.experts.N.gate_proj`` / ``up_proj`` / ``down_proj``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(base_dir)
    if cfg.model_type == "mixtral":
        block, names, E, I = "block_sparse_moe", ("w1", "w3", "w2"), cfg.num_local_experts, cfg.intermediate_size
    else:
        block, names, E, I = "mlp", ("gate_proj", "up_proj", "down_proj"), cfg.num_experts, cfg.moe_intermediate_size
    H = cfg.hidden_size
    q_out = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads)
    g = torch.Generator().manual_seed(seed)
    tensors = {}

    def add(module: str, fan_in: int, fan_out: int) -> None:
        prefix = f"base_model.model.model.layers.{layer}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) / fan_in ** 0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.3
    for layer in range(cfg.num_hidden_layers):
        add("self_attn.q_proj", H, q_out)
        add(f"{block}.gate", H, E)
        for e in range(E):
            add(f"{block}.experts.{e}.{names[0]}", H, I)
            add(f"{block}.experts.{e}.{names[1]}", H, I)
            add(f"{block}.experts.{e}.{names[2]}", I, H)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "gate", *names], "base_model_name_or_path": str(base_dir)}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def _check_mixed_batch(d: Path, adapters: dict[str, Path], prompts: list[str]):
    """Every prompt under the base model and each adapter, all in one generate call, against PEFT."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    names = [None, *adapters]
    refs, base_refs = [], None
    for name in names:
        pm = peft_reference_model(d, {name or "x": adapters[name or next(iter(adapters))]})
        outs = [peft_greedy(pm, name, tok.encode(p), MAX_TOKENS) for p in prompts]
        refs += outs
        if name is None:
            base_refs = outs
        else:                                                        # the adapter changes the output
            assert any(o.token_ids != b.token_ids for o, b in zip(outs, base_refs)), name
    llm = LLM(str(d), **ENGINE_KW)
    requests = [None if n is None else LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(names)]
    all_prompts = [p for _ in names for p in prompts]
    loras = [r for r in requests for _ in prompts]
    outputs = llm.generate(all_prompts, _params(), lora_request=loras, use_tqdm=False)
    labels = [f"{n or 'base'}: prompt {i}" for n in names for i in range(len(prompts))]
    exact = check_outputs_close(outputs, refs, labels)
    assert exact >= len(refs) - 1, f"only {exact}/{len(refs)} requests match PEFT token for token"
    return llm


def test_qwen3_moe_attention_experts_router(checkpoints, tiny_prompts, tmp_path):
    """Qwen3-MoE: PEFT's MLP targets on the experts (its stacked form, rank 8 on gate|up by rank_pattern) with
    q/k/v/o, explicit target_parameters on the experts and the router, and a transformers-4 per-expert adapter
    (``mlp.experts.N.gate_proj`` ...); max_loras 2, so the third adapter waits for a slot."""
    d = checkpoints("qwen3moe-8x2-norm")
    converted = build_peft_adapter(d, tmp_path / "all", r=4, lora_alpha=8, target_modules=ALL_TARGETS, seed=5)
    assert json.loads((converted / "adapter_config.json").read_text())["target_parameters"]
    explicit = build_peft_adapter(d, tmp_path / "params", r=4, lora_alpha=16, target_modules=["q_proj", "o_proj"],
                                  target_parameters=EXPERTS_AND_ROUTER, seed=6, use_rslora=True)
    per_expert = per_expert_adapter(d, tmp_path / "v4", r=4, alpha=8, seed=4)
    _check_mixed_batch(d, {"all": converted, "params": explicit, "v4": per_expert}, tiny_prompts[:3])


def test_qwen2_moe_shared_expert_experts_and_router(checkpoints, tiny_prompts, tmp_path):
    """Qwen2-MoE: PEFT's MLP targets reach the shared expert's and the dense layer's gate/up/down with q/k/v/o
    (q/k/v carry a bias; PEFT 0.21 does not turn them into target_parameters for this model); a second
    adapter on the routed experts and the router by explicit target_parameters."""
    from safetensors.torch import load_file

    d = checkpoints("qwen2moe-64x8-shared-dense1")
    modules = build_peft_adapter(d, tmp_path / "all", r=4, lora_alpha=8, target_modules=ALL_TARGETS, seed=9)
    names = load_file(str(modules / "adapter_model.safetensors"))
    assert any(".shared_expert.gate_proj.lora_A" in n for n in names)
    explicit = build_peft_adapter(d, tmp_path / "params", r=8, lora_alpha=16, target_modules=["v_proj"],
                                  target_parameters=EXPERTS_AND_ROUTER, seed=10)
    _check_mixed_batch(d, {"all": modules, "params": explicit}, tiny_prompts[:3])


def test_mixtral_stacked_and_per_expert(checkpoints, tiny_prompts, tmp_path):
    """Mixtral: target_parameters on the experts and the router with attention, and a transformers-4 per-expert
    adapter (``block_sparse_moe.experts.N.w1`` ...) with its router, which PEFT converts on load."""
    d = checkpoints("mixtral-8x2")
    stacked = build_peft_adapter(d, tmp_path / "params", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                 target_parameters=EXPERTS_AND_ROUTER, seed=7)
    per_expert = per_expert_adapter(d, tmp_path / "v4", r=4, alpha=8, seed=8)
    _check_mixed_batch(d, {"params": stacked, "v4": per_expert}, tiny_prompts[:3])


def _with_tensor(src: Path, dst: Path, key_end: str, change) -> Path:
    """A copy of adapter ``src`` whose tensors ending in ``key_end`` are replaced by ``change(tensor)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    hits = [k for k in tensors if k.endswith(key_end)]
    assert hits, key_end
    for k in hits:
        tensors[k] = change(tensors[k]).contiguous()
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_mismatched_expert_shapes_are_a_400_holding_nothing(checkpoints, tmp_path):
    """Expert tensors that do not fit the experts (another model's intermediate size, a rank that does not divide
    by the expert count) are refused at load with the module and the shapes named; the engine keeps serving and
    holds nothing of them."""
    from lora.errors import InvalidLoRAAdapterError

    d = checkpoints("mixtral-8x2")
    stacked = build_peft_adapter(d, tmp_path / "params", r=4, lora_alpha=8, target_modules=["q_proj"],
                                 target_parameters=EXPERTS_AND_ROUTER, seed=9)
    per_expert = per_expert_adapter(d, tmp_path / "v4", r=4, alpha=8, seed=10)
    bad = {
        "wide-up": (_with_tensor(per_expert, tmp_path / "b1", "experts.3.w3.lora_B.weight",
                                 lambda t: torch.cat([t, t[:8]])), r"experts\.3\.w3: shapes A \(4, 64\), B \(72, 4\)"),
        "down-in": (_with_tensor(stacked, tmp_path / "b2", "mlp.experts.lora_A.weight", lambda t: t[:, :40]),
                    r"model\.layers\.\d\.mlp\.experts\.down_proj: shapes A \(32, 40\)"),
        "rank": (_with_tensor(stacked, tmp_path / "b3", "experts.base_layer.lora_A.weight", lambda t: t[:30]),
                 r"gate_up_proj: shapes A \(30, 64\).*needs A \[r \* 8, 64\] and B \[128, r \* 8\]"),
    }
    llm = LLM(str(d), **ENGINE_KW)
    assert llm.llm_engine.add_lora(LoRARequest("good", 1, str(stacked)))
    for i, (name, (path, message)) in enumerate(bad.items()):
        with pytest.raises(InvalidLoRAAdapterError, match=message):
            llm.llm_engine.add_lora(LoRARequest(name, 10 + i, str(path)))
    assert [r.lora_name for r in llm.llm_engine.list_loras()] == ["good"]
    out = llm.generate(["hello there"], _params(), lora_request=LoRARequest("good", 1, str(stacked)),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS


def test_target_parameters_outside_the_experts_are_refused(checkpoints, tiny_llama_dir, tmp_path):
    """target_parameters that name anything but the experts and the router, or any on a dense model, are refused
    by the adapter reader with what the model takes."""
    from transformers import AutoConfig

    from engine.models.llama import LlamaForCausalLM
    from engine.models.mixtral import MixtralForCausalLM
    from lora.errors import InvalidLoRAAdapterError
    from lora.peft_adapter import LoRATargets, read_adapter_config

    d = checkpoints("mixtral-8x2")
    adapter = build_peft_adapter(d, tmp_path / "p", r=4, lora_alpha=8, target_modules=["q_proj"],
                                 target_parameters=EXPERTS_AND_ROUTER, seed=1)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    moe = LoRATargets.from_model(MixtralForCausalLM(AutoConfig.from_pretrained(d), 64))
    assert set(read_adapter_config(adapter, 16, moe.suffixes).target_parameters) == set(EXPERTS_AND_ROUTER)
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "target_parameters": ["input_layernorm.weight"]}))
    with pytest.raises(InvalidLoRAAdapterError, match=r"\['input_layernorm.weight'\] are not supported; this model "
                                                      r"takes \['gate_up_proj', 'down_proj', 'gate.weight'\]"):
        read_adapter_config(adapter, 16, moe.suffixes)
    dense = LoRATargets.from_model(LlamaForCausalLM(AutoConfig.from_pretrained(tiny_llama_dir), 64))
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidLoRAAdapterError, match="routed experts of MoE models only"):
        read_adapter_config(adapter, 16, dense.suffixes)


def test_mismatched_experts_over_http(checkpoints, tmp_path):
    """/v1/load_lora_adapter with expert tensors that do not fit: a 400 on lora_path (the reason goes to the
    server log only), the adapter not listed or served; a fitting one loads and serves."""
    import httpx

    from tests.server.conftest import start_server

    d = checkpoints("mixtral-8x2")
    good = per_expert_adapter(d, tmp_path / "good", r=4, alpha=8, seed=11)
    bad = _with_tensor(good, tmp_path / "bad", "experts.5.w2.lora_A.weight", lambda t: t[:, :32])
    srv = start_server(str(d), served_model_name=["moe"], max_model_len=128, enable_lora=True,
                       allow_runtime_lora_updating=True, max_loras=2, max_lora_rank=8)
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        models = {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
        assert models == {"moe"}
        r = httpx.post(srv.url + "/v1/completions", json={"model": "bad", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404, r.text
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(good)})
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"model": "good", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    finally:
        srv.stop()
