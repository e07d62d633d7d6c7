"""Dummy weights with ``--quantization fp8`` (``load_format='dummy'``, the benchmarks' shapes): each projection is
drawn and quantized before the next, so the float model is never whole in memory (a 70B shape's FP8 weights fit
one GPU, its bf16 ones do not), and the model equals the one drawn whole in float and quantized after."""

from __future__ import annotations

import contextlib

import pytest

from engine import LLM, SamplingParams
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from engine.models import builder

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 8, 91]}, {"prompt_token_ids": [200, 3, 44]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)


def _float_weights_alive(model) -> int:
    """Projections holding a float weight with memory (not meta, not quantized yet)."""
    return sum(1 for m in model.modules() if isinstance(m, Linear) and m.weight is not None and not m.weight.is_meta)


def _dummy_fp8(model_dir, monkeypatch, whole_float_first: bool):
    """The dummy FP8 engine and the most float projections alive at any quantization; ``whole_float_first``:
    the whole float model drawn first, then quantized (projections built with memory)."""
    if whole_float_first:
        monkeypatch.setattr(builder, "deferred_weights", contextlib.nullcontext)
    alive: list[int] = []
    models: list = []
    original = Linear.quantize_fp8

    def counting(self):
        alive.append(_float_weights_alive(models[0]) if models else -1)
        original(self)

    original_init = builder._init_dummy

    def remember(model, *args, **kwargs):
        models.append(model)
        original_init(model, *args, **kwargs)

    monkeypatch.setattr(Linear, "quantize_fp8", counting)
    monkeypatch.setattr(builder, "_init_dummy", remember)
    llm = LLM(model=str(model_dir), load_format="dummy", device="cpu", dtype="float32", quantization="fp8",
              max_model_len=64, seed=0)
    monkeypatch.undo()
    return llm, alive


def test_dummy_fp8_quantizes_each_projection_as_drawn_and_equals_the_whole_float_model(tiny_llama_dir,
                                                                                       monkeypatch):
    llm, alive = _dummy_fp8(tiny_llama_dir, monkeypatch, whole_float_first=False)
    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight_q, Fp8Weight) and m.weight is None for m in linears)
    assert len(alive) == len(linears) and max(alive) == 1            # only the projection being quantized
    ref, ref_alive = _dummy_fp8(tiny_llama_dir, monkeypatch, whole_float_first=True)
    assert ref_alive[0] == len(linears)                               # the whole float model first
    for a, b in zip(llm.generate(PROMPTS, GREEDY, use_tqdm=False), ref.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-6) for t in y)
