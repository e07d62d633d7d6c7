"""benchmarks/multi_lora.py: the adapters it writes for a dense and a MoE shape (every routed expert, PEFT's
per-expert names) load into the engine's expert slots and change the answers, and tiny runs on the FP8 base and
on the MoE give a row per engine and adapter count."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.multi_lora import adapter_modules, write_random_adapter
from benchmarks.shapes import dummy_model, shape_fields
from tests.benchmark_module import load_benchmark


def test_adapter_modules_of_the_dense_and_moe_shapes():
    dense = adapter_modules(shape_fields("llama3-8b")[2])
    assert [m[0] for m in dense] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert dense[0][1:] == (4096, 4096) and dense[1][1:] == (4096, 1024) and dense[6][1:] == (14336, 4096)
    moe = adapter_modules(shape_fields("qwen3-30b-a3b")[2])                 # 32 heads of 128 on hidden 2048
    assert moe[:4] == [("self_attn.q_proj", 2048, 4096), ("self_attn.k_proj", 2048, 512),
                       ("self_attn.v_proj", 2048, 512), ("self_attn.o_proj", 4096, 2048)]
    assert len(moe) == 4 + 3 * 128
    assert moe[4:7] == [("mlp.experts.0.gate_proj", 2048, 768), ("mlp.experts.0.up_proj", 2048, 768),
                        ("mlp.experts.0.down_proj", 768, 2048)]
    assert moe[-1] == ("mlp.experts.127.down_proj", 768, 2048)


def test_moe_adapter_fills_the_expert_slots_and_changes_the_answer(tmp_path, monkeypatch):
    from engine import LLM, SamplingParams
    from lora import LoRARequest
    from lora.expert_layers import ExpertLoRASlots
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    adapter = write_random_adapter(tmp_path / "a", shape_fields("qwen3-30b-a3b", tiny=True)[2], 8, seed=1)
    llm = LLM(dummy_model("qwen3-30b-a3b", tiny=True), load_format="dummy", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=64, seed=0)
    prompt, params = [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with_adapter = llm.generate(prompt, params, lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)
    base = llm.generate(prompt, params, use_tqdm=False)
    assert with_adapter[0].outputs[0].token_ids != base[0].outputs[0].token_ids
    slots = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, ExpertLoRASlots)]
    assert len(slots) == 2                                                  # every layer of the tiny MoE is sparse
    for s in slots:                                                         # the adapter's slot, every expert
        assert all(bool(s.a13[:, e].abs().sum() > 0) and bool(s.b2[:, e].abs().sum() > 0) for e in range(8))


@pytest.mark.parametrize("shape,flags,targets", [
    ("llama3-8b", ["--quantization", "fp8"], "all 7 projections"),
    ("qwen3-30b-a3b", [], "q/k/v/o and every routed expert's gate/up/down")])
def test_tiny_runs_on_the_fp8_base_and_the_moe(shape, flags, targets, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["multi_lora.py", "--shape", shape, "--tiny", *flags, "--batch-sizes", "4", "--num-adapters", "0,2", "--input-len", "8",
                                      "--output-len", "3", "--skip-hf", "--workdir", str(tmp_path / "w"),
                                      "--out", str(out)])
    load_benchmark("multi_lora.py", "bench_multi_lora_unit").main()
    report = json.loads(out.read_text())
    assert report["targets"] == targets and report["args"]["quantization"] == (flags[1] if flags else None)
    rows = {(r["system"], r["num_adapters"]): r for r in report["rows"]}
    assert set(rows) == {("chorus base (LoRA off)", 0), ("chorus 0 adapters", 0), ("chorus 2 adapters", 2)}
    assert all(r["output_tokens"] == 4 * 3 and r["x_base"] > 0 for r in rows.values())
