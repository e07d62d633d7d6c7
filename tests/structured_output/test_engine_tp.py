"""Constrained decoding with tensor_parallel_size 2 (gloo, 2 processes, float32): every rank samples every
row, so every rank must mask with the same grammar bitmask (rank 0 broadcasts it between the forward and the
sampler). A worker that sampled without it would feed itself other tokens than rank 0 from the next step
on, and the outputs would part from size 1's: they are equal, greedy and seeded, and follow their grammars."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.conftest import TINY_PROMPTS
from tests.structured_output.cases import KINDS, check_text, constraint

ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=96, seed=0)


def _run(model_dir, tp: int) -> list:
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **ENGINE_KW)
    try:
        prompts, params = [], []
        for i, kind in enumerate(KINDS):
            for j, sampling in enumerate([dict(temperature=0), dict(temperature=1.0, seed=40 + i)]):
                prompts.append(TINY_PROMPTS[(i + j) % len(TINY_PROMPTS)])
                params.append(SamplingParams(max_tokens=64, structured_outputs=constraint(kind), **sampling))
        prompts.append(TINY_PROMPTS[5])
        params.append(SamplingParams(temperature=0, max_tokens=16))
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.close()


def test_tp2_constrained_outputs_equal_tp1(tiny_llama_dir):
    one, two = _run(tiny_llama_dir, 1), _run(tiny_llama_dir, 2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    kinds = [k for k in KINDS for _ in range(2)]
    for kind, out in zip(kinds, two):
        assert out.finish_reason == "stop", (kind, out.text)
        check_text(kind, out.text)
