"""tensor_parallel_size 2 (gloo, 2 processes, float32) gives the tokens of size 1, and logprobs within
1e-3, on tiny random checkpoints with two PEFT adapters on all seven projections (one rsLoRA) in one
batch next to base-model requests:

- llama: 4 query heads, 2 KV heads (split, one per rank), untied LM head;
- qwen2: q/k/v biases, 1 KV head (replicated on both ranks), tied embeddings, and a vocabulary of 387
  rows (not a multiple of 2: the last rank's shard is padded).

One engine of each size per checkpoint; the size-2 engine's worker is spawned once per checkpoint. A GGUF
file runs sharded from its converted checkpoint too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine import LLM, SamplingParams
from lora.request import LoRARequest
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.models.utils import check_logprobs_close, ours_as_ref

MAX_TOKENS = 6
ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=96,
                 enable_lora=True, max_loras=2, max_lora_rank=8, seed=0)
PROMPTS = TINY_PROMPTS[:4]


@dataclass
class Run:
    outputs: list
    """Per (prompt, adapter) pair of ``_requests``: the ``CompletionOutput``."""
    swapped: list
    """After unloading "a" and loading adapter b's files under the name "a": each prompt under "a"."""


def _requests(adapters: dict) -> tuple[list[str], list]:
    prompts, loras = [], []
    for i, name in enumerate([None, "a", "b"]):
        for p in PROMPTS:
            prompts.append(p)
            loras.append(None if name is None else LoRARequest(name, i, str(adapters[name])))
    return prompts, loras


def _run(model_dir, adapters: dict, tp: int) -> Run:
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **ENGINE_KW)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
        prompts, loras = _requests(adapters)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]
        engine = llm.llm_engine
        assert engine.remove_lora("a")   # idle: removed at once, on every rank with the next step
        engine.add_lora(LoRARequest("a", 7, str(adapters["b"])))
        swapped = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                      lora_request=LoRARequest("a", 7, str(adapters["b"])))]
        return Run(outputs, swapped)
    finally:
        llm.llm_engine.core.shutdown()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runs(request, tiny_llama_dir, tmp_path_factory):
    if request.param == "llama":
        model_dir = tiny_llama_dir
    else:
        model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("tp-qwen2"), "qwen2", seed=3,
                                          num_key_value_heads=1, tie_word_embeddings=True, vocab_size=387)
    out = tmp_path_factory.mktemp(f"tp-adapters-{request.param}")
    adapters = {"a": build_peft_adapter(model_dir, out / "a", r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                        seed=1, use_rslora=True),
                "b": build_peft_adapter(model_dir, out / "b", r=4, lora_alpha=8, target_modules=ALL_TARGETS,
                                        seed=2)}
    return request.param, _run(model_dir, adapters, tp=1), _run(model_dir, adapters, tp=2)


def test_tp2_greedy_equals_tp1(runs):
    name, ref, ours = runs
    assert len(ours.outputs) == 3 * len(PROMPTS)
    for i, (a, b) in enumerate(zip(ref.outputs, ours.outputs)):
        assert list(a.token_ids) == list(b.token_ids), f"{name} request {i}"
        assert check_logprobs_close(ours_as_ref(a), ours_as_ref(b), f"{name} request {i}", atol=1e-3) == MAX_TOKENS
    # the adapters change the outputs, so the comparison covers their shards
    base, with_a = ref.outputs[:len(PROMPTS)], ref.outputs[len(PROMPTS):2 * len(PROMPTS)]
    assert any(list(x.token_ids) != list(y.token_ids) for x, y in zip(base, with_a))


def test_unload_and_reload_reach_every_rank(runs):
    """Adapter b's files loaded under a's name after a was unloaded: every rank serves b's weights."""
    name, ref, ours = runs
    b_outputs = ours.outputs[2 * len(PROMPTS):]
    for i, (x, y) in enumerate(zip(ours.swapped, b_outputs)):
        assert list(x.token_ids) == list(y.token_ids), f"{name} prompt {i}"
    for x, y in zip(ref.swapped, ours.swapped):
        assert list(x.token_ids) == list(y.token_ids)


def test_gguf_runs_sharded_from_its_converted_directory(tiny_llama_dir, tmp_path, monkeypatch):
    """A GGUF file (1 KV head: replicated) is read at TP=2 from its converted checkpoint like any other,
    each rank taking its slices: the tokens of TP=1."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models.test_gguf import write_tiny_gguf

    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path / "cache"))
    cfg = AutoConfig.for_model("llama", vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, AutoModelForCausalLM.from_config(cfg), tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM(str(gguf), device="cpu", num_gpu_blocks_override=32, tensor_parallel_size=tp)
        try:
            tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        finally:
            llm.llm_engine.core.shutdown()
    assert tokens[0] == tokens[1]
