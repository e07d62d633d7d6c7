"""``reasoning_parser`` in the engine: a constrained request reasons unconstrained, then its grammar applies
after ``</think>``; a prompt that closes the think block constrains from the first token; without a parser
the grammar applies from the first token; a tokenizer without the tags stops start-up.

The tiny random model is edited so that its greedy reply to ``PROMPT`` writes ``</think>`` after
``THINK_TOKENS`` free tokens: the ``</think>`` row of ``lm_head`` becomes a scaled copy of the row of the
token it would have written there (whose logit is the largest at that position only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.structured_output.params import StructuredOutputsParams

PROMPT = "Hello"
THINK_TOKENS = 2
CHOICES = ["yes", "no"]
ENGINE_KWARGS = dict(max_model_len=256)


def greedy(max_tokens: int = 12, constrained: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(choice=CHOICES) if constrained else None)


@pytest.fixture(scope="module")
def free_reply(tiny_thinking_dir) -> list[int]:
    llm = LLM(model=str(tiny_thinking_dir), **ENGINE_KWARGS)
    out, = llm.generate([PROMPT], greedy(constrained=False), use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def closing_dir(tiny_thinking_dir, free_reply, tmp_path_factory) -> Path:
    """The model, with ``</think>`` as the greedy choice at output position THINK_TOKENS of PROMPT."""
    out = tmp_path_factory.mktemp("closes-thinking")
    shutil.copytree(tiny_thinking_dir, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    target = free_reply[THINK_TOKENS]
    assert target not in free_reply[:THINK_TOKENS]
    end_id = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("</think>")
    weights["lm_head.weight"][end_id] = weights["lm_head.weight"][target] * 1.05
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def llm(closing_dir) -> LLM:
    return LLM(model=str(closing_dir), reasoning_parser="deepseek_r1", **ENGINE_KWARGS)


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.scheduler.requests and engine.scheduler.structured_output.num_requests() == 0
    assert engine.get_stats().num_kv_blocks_in_use == 0


def test_the_grammar_applies_after_the_reasoning(llm, free_reply):
    tok = llm.get_tokenizer()
    end_id = tok.convert_tokens_to_ids("</think>")
    free, = llm.generate([PROMPT], greedy(constrained=False), use_tqdm=False)
    assert list(free.outputs[0].token_ids[:THINK_TOKENS + 1]) == free_reply[:THINK_TOKENS] + [end_id]
    out, = llm.generate([PROMPT], greedy(), use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    assert ids[:THINK_TOKENS + 1] == free_reply[:THINK_TOKENS] + [end_id]   # reasoning: the model's own tokens
    assert tok.decode(ids[THINK_TOKENS + 1:], skip_special_tokens=True) in CHOICES
    assert out.outputs[0].finish_reason == "stop"
    assert_idle(llm)


def test_unfinished_reasoning_is_unconstrained(llm):
    """A reply cut off inside its reasoning is the unconstrained reply (the grammar never started)."""
    prompts = ["What is the capital of France?", "A"]
    free = llm.generate(prompts, greedy(max_tokens=6, constrained=False), use_tqdm=False)
    end_id = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    cut = [p for p, f in zip(prompts, free) if end_id not in f.outputs[0].token_ids]
    assert cut
    constrained = llm.generate(cut, greedy(max_tokens=6), use_tqdm=False)
    by_prompt = dict(zip(prompts, free))
    for prompt, out in zip(cut, constrained):
        assert out.outputs[0].token_ids == by_prompt[prompt].outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_a_prompt_that_closes_the_think_block_is_constrained_from_the_start(llm):
    out, = llm.generate([PROMPT + "<think>\n\n</think>\n\n"], greedy(), use_tqdm=False)
    assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"


def test_without_a_reasoning_parser_the_grammar_applies_from_the_first_token(closing_dir):
    llm = LLM(model=str(closing_dir), **ENGINE_KWARGS)
    out, = llm.generate([PROMPT], greedy(), use_tqdm=False)
    assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"


def test_a_tokenizer_without_the_tags_stops_start_up(tiny_llama_dir):
    with pytest.raises(ValueError, match="no single token for <think>, </think>"):
        LLM(model=str(tiny_llama_dir), reasoning_parser="qwen3", **ENGINE_KWARGS)


def test_an_unknown_reasoning_parser_is_refused(tiny_thinking_dir):
    with pytest.raises(ValueError, match="reasoning_parser='r2': use one of deepseek_r1, qwen3"):
        LLM(model=str(tiny_thinking_dir), reasoning_parser="r2", **ENGINE_KWARGS)
