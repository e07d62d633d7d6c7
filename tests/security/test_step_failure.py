"""No output is lost when one request of a step fails.

``LLMEngine.step`` returns the failed request as a final ``RequestOutput`` carrying the error
(``error``, finish reason 'error') next to every other request's outputs of that step, final ones
included; ``LLM.generate`` returns the whole batch, every other completion intact. The failures come
from the engine's own hooks: a LoRA adapter whose files vanish after its host copy was dropped (only
its request fails, the step goes on), and ``inject_step_faults`` (the step's requests fail, the
waiting ones run afterwards).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import EngineStepError
from engine.llm_engine import LLMEngine
from lora import LoRARequest
from lora.errors import LoRAAdapterNotFoundError
from tests.lora.utils import ALL_TARGETS, build_peft_adapter

PROMPTS = ["The quick brown fox", "Hello there, how are", "One two three four", "A B C D E F"]
MAX_STEPS = 6
LORA_KW = dict(max_model_len=256, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)


def _params(max_tokens: int = 6, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


@pytest.fixture(scope="module")
def adapter_src(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("step-failure-adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return {name: build_peft_adapter(tiny_llama_dir, root / name, r=8, lora_alpha=16,
                                     target_modules=ALL_TARGETS, seed=seed, base_model=base)
            for seed, name in enumerate(["a", "b"])}


def _vanished_adapter(engine: LLMEngine, adapter_src: dict[str, Path], tmp_path: Path,
                      name: str) -> LoRARequest:
    """An adapter registered, pushed out of host memory (max_cpu_loras=1) by another, then deleted:
    the step that loads it into a slot finds no files."""
    path = Path(shutil.copytree(adapter_src["a"], tmp_path / name))
    lora = LoRARequest(name, 1, str(path))
    engine.add_lora(lora)
    engine.add_lora(LoRARequest("b", 2, str(adapter_src["b"])))
    assert engine.lora_manager.store.names() == ["b"]
    shutil.rmtree(path)
    return lora


def _assert_idle(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0 and stats.num_lora_slots_in_use == 0


def test_step_returns_the_others_outputs_final_ones_included_and_the_failed_ones_error(
        tiny_llama_dir, adapter_src, tmp_path):
    """Synchronous scheduling, and beside the adapter's request one base request ending at each of
    the first ``MAX_STEPS`` steps: whichever step fails the adapter's request (the adapter is read again
    off the step loop) also ends another one, and both come back from that one ``step()``."""
    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), async_scheduling=False, **LORA_KW)
    budgets = {f"s{k}": k for k in range(1, MAX_STEPS + 1)}             # s3 ends at the third step
    refs = {}
    for rid, max_tokens in budgets.items():
        engine.add_request(rid, PROMPTS[0], _params(max_tokens))
    while engine.has_unfinished_requests():
        refs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    lora = _vanished_adapter(engine, adapter_src, tmp_path, "gone")
    engine.add_request("bad", PROMPTS[0], _params(6), lora_request=lora)
    for rid, max_tokens in budgets.items():
        engine.add_request(rid, PROMPTS[0], _params(max_tokens))

    steps = []
    while engine.has_unfinished_requests():
        steps.append({o.request_id: o for o in engine.step()})
        if not any("bad" in step for step in steps):
            time.sleep(0.05)   # room for the adapter's read, so that it fails within MAX_STEPS steps
    failing = next(i for i, step in enumerate(steps) if "bad" in step)
    assert failing < MAX_STEPS and sum("bad" in step for step in steps) == 1
    step = steps[failing]
    bad = step["bad"]
    assert bad.finished and isinstance(bad.error, LoRAAdapterNotFoundError) and "'gone'" in str(bad.error)
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    ending = f"s{failing + 1}"
    assert set(step) == {"bad"} | {f"s{k}" for k in range(failing + 1, MAX_STEPS + 1)}
    assert step[ending].finished and step[ending].error is None
    finals = {rid: out for step in steps for rid, out in step.items() if out.finished}
    assert set(finals) == {"bad"} | set(budgets)
    for rid in budgets:
        assert finals[rid].error is None and finals[rid].outputs[0].token_ids == refs[rid], rid
    _assert_idle(engine)


def test_generate_returns_every_other_completion_when_an_adapter_vanishes(tiny_llama_dir, adapter_src,
                                                                         tmp_path):
    llm = LLM(str(tiny_llama_dir), **LORA_KW)
    lora_b = LoRARequest("b", 2, str(adapter_src["b"]))
    prompts = PROMPTS + [PROMPTS[2]]
    refs = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), use_tqdm=False,
                                                         lora_request=[None, None, None, lora_b, None])]
    ref_n2 = [c.token_ids for c in llm.generate(PROMPTS[2], _params(n=2), use_tqdm=False)[0].outputs]
    lora = _vanished_adapter(llm.llm_engine, adapter_src, tmp_path, "gone")

    outs = llm.generate(prompts, [_params()] * 4 + [_params(n=2)], use_tqdm=False,
                        lora_request=[None, lora, None, lora_b, None])
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)   # input order
    assert isinstance(outs[1].error, LoRAAdapterNotFoundError) and outs[1].finished
    assert [c.finish_reason for c in outs[1].outputs] == ["error"]
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == refs[i], i
        assert outs[i].outputs[0].finish_reason == "length"
    assert outs[4].error is None and [c.token_ids for c in outs[4].outputs] == ref_n2
    # n > 1 on the vanished adapter: both sequences end with the error, the request once.
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [_params(n=2), _params()], use_tqdm=False,
                        lora_request=[lora, None])
    assert isinstance(outs[0].error, LoRAAdapterNotFoundError)
    assert [c.finish_reason for c in outs[0].outputs] == ["error", "error"]
    assert outs[1].error is None and outs[1].outputs[0].token_ids == refs[1]
    _assert_idle(llm.llm_engine)
    llm.close()


def test_generate_returns_the_waiting_requests_after_a_step_fault(tiny_llama_dir):
    """max_num_seqs=2: the first step runs prompts 0 and 1 and raises (``inject_step_faults``); they
    come back with the step's ``EngineStepError``, prompts 2 and 3 run afterwards, as without the fault."""
    with LLM(str(tiny_llama_dir), max_model_len=256, max_num_seqs=2) as llm:
        refs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
        llm.llm_engine.core.inject_step_faults(RuntimeError("injected fault"), 1)
        outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert len(outs) == len(PROMPTS)
        for out in outs[:2]:
            assert isinstance(out.error, EngineStepError) and "injected fault" in str(out.error)
            assert out.finished and [c.finish_reason for c in out.outputs] == ["error"]
        for out, ref in zip(outs[2:], refs[2:]):
            assert out.error is None and out.outputs[0].token_ids == ref
        again = llm.generate(PROMPTS, _params(), use_tqdm=False)   # the engine goes on
        assert [o.outputs[0].token_ids for o in again] == refs
        _assert_idle(llm.llm_engine)
