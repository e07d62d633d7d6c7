"""Constrained decoding through the engine, offline (``LLM.generate``), on a tiny random Llama: every kind
in one batch with unconstrained requests and adapters; greedy constrained tokens equal the unconstrained
model's wherever the grammar allows its choice; ``n`` > 1, logprobs (raw and processed), stop strings,
chunked prefill with preemption, async scheduling on and off; bad constraints are a ``ValueError`` that
leaves nothing queued; a grammar slow to compile holds back no other request; the reasoning hook."""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch

import engine.processor as processor_module
import engine.structured_output.compiler as compiler_module
from engine import LLM, SamplingParams
from engine.reasoning.parser import ReasoningState, ThinkTagIds
from engine.request import RequestStatus
from engine.structured_output.bitmask import allocate_bitmask, unpack_bitmask
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.params import StructuredOutputsParams
from lora import LoRARequest
from tests.conftest import TINY_PROMPTS
from tests.lora.utils import ALL_TARGETS, build_peft_adapter
from tests.structured_output.cases import CHOICES, KINDS, check_text, constraint

MAX_TOKENS = 64
ENGINE_KWARGS = dict(max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
"""The engine of most tests: adapters on, async scheduling and prefix caching on (the defaults)."""


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("so-adapters")
    return {name: LoRARequest(name, i + 1, str(build_peft_adapter(
        tiny_llama_dir, root / name, r=8, lora_alpha=16, target_modules=ALL_TARGETS, seed=i + 1)))
        for i, name in enumerate(["a", "b"])}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **ENGINE_KWARGS)


def greedy(structured_outputs=None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=structured_outputs,
                          **kwargs)


def assert_idle(llm: LLM) -> None:
    """Nothing queued, no matcher, no KV block held."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.requests
    assert engine.scheduler.structured_output.num_requests() == 0
    assert engine.get_stats().num_kv_blocks_in_use == 0


def allowed_ids(llm: LLM, params: StructuredOutputsParams, prefix: list[int]) -> set[int]:
    """The ids the grammar of ``params`` allows after the output ``prefix`` (the engine's own grammar)."""
    matcher = llm.llm_engine.processor.grammar_pool.submit(params).result().new_matcher()
    assert matcher.accept_tokens(prefix), prefix
    vocab_size = llm.llm_engine.processor.grammar_pool.vocab_size
    bitmask = allocate_bitmask(1, vocab_size, pin_memory=False)
    matcher.fill_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist())


def test_every_kind_in_one_batch_with_unconstrained_requests(llm):
    prompts, params, kinds = [], [], []
    for i, kind in enumerate(KINDS * 2):
        prompts.append(TINY_PROMPTS[i % len(TINY_PROMPTS)])
        params.append(greedy(constraint(kind)))
        kinds.append(kind)
    for prompt in TINY_PROMPTS:
        prompts.append(prompt)
        params.append(greedy(StructuredOutputsParams(json_object=True, disable_any_whitespace=True)))
        kinds.append("json_object")
    prompts += TINY_PROMPTS[:2]
    params += [greedy(), greedy()]
    kinds += [None, None]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    objects_done = 0
    for kind, out in zip(kinds, outputs):
        completion = out.outputs[0]
        if kind is None:
            assert len(completion.token_ids) > 0
        elif kind == "json_object" and completion.finish_reason == "length":
            assert completion.text.startswith("{")   # a random model's object may not close in time
        else:
            assert completion.finish_reason == "stop", (kind, completion.text)
            check_text(kind, completion.text)
            objects_done += kind == "json_object"
    assert objects_done >= 2
    assert llm.llm_engine.get_stats().max_reqs_per_step >= len(prompts) // 2
    assert_idle(llm)


def test_n_samples_each_follow_the_grammar(llm):
    out, = llm.generate(["Hello"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                                  structured_outputs=constraint("regex")), use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        check_text("regex", completion.text)
    assert_idle(llm)


def test_mixed_batch_greedy_follows_the_unconstrained_choice(llm, adapters):
    """Constrained and unconstrained requests, with and without adapters, in one batch. At every step of a
    constrained greedy request, the unconstrained model's choice (a separate request on the same prefix and
    adapter) is its token whenever the grammar allows it; unconstrained requests are untouched."""
    plan = [(0, None, "regex"), (1, "a", "choice"), (2, None, None), (3, "b", "json"), (4, "a", None),
            (5, None, "grammar"), (6, "b", "regex"), (0, "a", "json"), (7, "b", None), (1, None, "choice")]
    tok = llm.get_tokenizer()
    prompts = [TINY_PROMPTS[p] for p, _, _ in plan]
    loras = [adapters[a] if a else None for _, a, _ in plan]
    params = [greedy(constraint(kind) if kind else None) for _, _, kind in plan]
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    assert llm.llm_engine.get_stats().max_reqs_per_step >= len(plan)

    # References: the unconstrained requests alone, and one unconstrained step on every constrained prefix.
    free = [i for i, (_, _, kind) in enumerate(plan) if kind is None]
    ref_free = llm.generate([prompts[i] for i in free], greedy(), lora_request=[loras[i] for i in free],
                            use_tqdm=False)
    for i, ref in zip(free, ref_free):
        assert outs[i].outputs[0].token_ids == ref.outputs[0].token_ids, plan[i]
    steps = [(i, t) for i, (_, _, kind) in enumerate(plan) if kind
             for t in range(len(outs[i].outputs[0].token_ids))]
    step_prompts = [{"prompt_token_ids": tok.encode(prompts[i]) + list(outs[i].outputs[0].token_ids[:t])}
                    for i, t in steps]
    refs = llm.generate(step_prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                        lora_request=[loras[i] for i, _ in steps], use_tqdm=False)
    followed = overridden = 0
    for (i, t), ref in zip(steps, refs):
        ours = outs[i].outputs[0].token_ids
        allowed = allowed_ids(llm, params[i].structured_outputs, list(ours[:t]))
        assert ours[t] in allowed, (plan[i], t)
        choice = ref.outputs[0].token_ids[0]
        if choice in allowed:
            top = ref.outputs[0].logprobs[0]
            tie = ours[t] in top and abs(top[ours[t]].logprob - top[choice].logprob) < 1e-4
            assert ours[t] == choice or tie, (plan[i], t, ours[t], choice)
            followed += 1
        else:
            overridden += 1
    assert followed > 0 and overridden > 0, (followed, overridden)
    assert_idle(llm)


def test_raw_logprobs_are_the_models(llm):
    """logprobs_mode raw_logprobs: a constrained token's logprob is the model's own (the grammar is not in
    it), as the prompt logprobs of the same tokens say."""
    tok = llm.get_tokenizer()
    out, = llm.generate(["Hello"], greedy(constraint("choice"), logprobs=3), use_tqdm=False)
    completion = out.outputs[0]
    check_text("choice", completion.text)
    assert len(completion.logprobs) == len(completion.token_ids)
    prompt_ids = tok.encode("Hello")
    ref, = llm.generate([{"prompt_token_ids": prompt_ids + list(completion.token_ids)}],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    # On CUDA the prefill and decode kernels round differently (tf32 dots): the same logprob within 3e-2.
    tol = 3e-2 if torch.cuda.is_available() else 1e-4
    for t, token_id in enumerate(completion.token_ids):
        ours = completion.logprobs[t][token_id].logprob
        assert math.isfinite(ours)
        assert ours == pytest.approx(ref.prompt_logprobs[len(prompt_ids) + t][token_id].logprob, abs=tol)
    total = sum(completion.logprobs[t][token_id].logprob for t, token_id in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_processed_logprobs_see_the_grammar(tiny_llama_dir):
    """logprobs_mode processed_logprobs: the top logprobs come from the masked logits: every token with a
    finite logprob is one the grammar allows, and the step's logprobs are normalized over those."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, logprobs_mode="processed_logprobs")
    params = greedy(constraint("choice"), logprobs=5)
    out, = llm.generate(["Hello"], params, use_tqdm=False)
    completion = out.outputs[0]
    check_text("choice", completion.text)
    for t, step in enumerate(completion.logprobs):
        allowed = allowed_ids(llm, params.structured_outputs, list(completion.token_ids[:t]))
        finite = {token_id for token_id, lp in step.items() if math.isfinite(lp.logprob)}
        assert finite and finite <= allowed, (t, finite - allowed)
        assert sum(math.exp(step[i].logprob) for i in finite) <= 1 + 1e-4
    last = completion.logprobs[-1][completion.token_ids[-1]]
    assert last.logprob == pytest.approx(0.0, abs=1e-4)   # EOS, the only token the grammar allows there


def test_stop_string_ends_a_constrained_request(llm):
    out, = llm.generate(["Hello"], greedy(StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{3}"), stop=["-"]),
                        use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "-"
    assert re.fullmatch(r"[a-z]{3}", completion.text), completion.text
    assert_idle(llm)


def test_chunked_prefill_and_preemption(tiny_llama_dir):
    """Prompts computed in chunks of 8 tokens and a KV cache too small for the batch (requests preempted
    and recomputed, their matchers kept): every output still follows its grammar."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, max_num_batched_tokens=8, num_gpu_blocks_override=12,
              block_size=16)
    prompts = [p for p in TINY_PROMPTS for _ in KINDS]
    kinds = [k for _ in TINY_PROMPTS for k in KINDS]
    outputs = llm.generate(prompts, [greedy(constraint(k)) for k in kinds], use_tqdm=False)
    for kind, out in zip(kinds, outputs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check_text(kind, out.outputs[0].text)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_idle(llm)


def test_async_scheduling_on_and_off_give_the_same_tokens(tiny_llama_dir, llm, adapters):
    sync = LLM(str(tiny_llama_dir), async_scheduling=False, **ENGINE_KWARGS)
    prompts, params, loras = [], [], []
    for i, kind in enumerate(KINDS):
        for j, sampling in enumerate([dict(temperature=0), dict(temperature=0.9, seed=100 + i)]):
            prompts.append(TINY_PROMPTS[(i + j) % len(TINY_PROMPTS)])
            params.append(SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=constraint(kind),
                                         **sampling))
            loras.append(adapters["a"] if j else None)
    prompts.append(TINY_PROMPTS[3])
    params.append(greedy())
    loras.append(None)
    on = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    off = sync.generate(prompts, params, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert_idle(sync)


@pytest.mark.parametrize("bad, reason", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "Unsupported type"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "uniqueItems"),
    (StructuredOutputsParams(regex="(a"), "parenthesis is not closed"),
    (StructuredOutputsParams(grammar="root ::= missing"), 'Rule "missing" is not defined'),
], ids=["invalid-schema", "unsupported-keyword", "bad-regex", "bad-grammar"])
def test_bad_constraint_is_a_value_error_before_anything_is_queued(llm, bad, reason):
    with pytest.raises(ValueError, match=reason) as info:
        llm.generate(["Hello", "A"], [greedy(), greedy(bad)], use_tqdm=False)
    assert isinstance(info.value, StructuredOutputError) and info.value.param == "structured_outputs"
    assert str(info.value).startswith("structured_outputs: ")
    assert_idle(llm)
    out, = llm.generate(["A"], greedy(constraint("regex")), use_tqdm=False)   # the engine still serves
    check_text("regex", out.outputs[0].text)


def test_malformed_params_are_value_errors():
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="exactly one kind"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


def test_backend_that_cannot_read_the_tokenizer(tiny_llama_dir, monkeypatch):
    """A named backend that cannot read the model's tokenizer: unconstrained requests are served, each
    constrained one is a ValueError with the reason."""
    def unreadable(name, tokenizer, vocab_size, stop_token_ids=None):
        raise StructuredOutputError(f"{name} cannot read this model's tokenizer: (a test)", backend=name)

    monkeypatch.setattr(compiler_module, "make_backend", unreadable)
    llm = LLM(str(tiny_llama_dir), max_model_len=256, structured_outputs_backend="xgrammar")
    assert llm.generate(["A"], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="xgrammar cannot read this model's tokenizer"):
        llm.generate(["A"], greedy(constraint("regex")), use_tqdm=False)
    assert_idle(llm)


class _GatedBackend:
    """Compiles like ``backend``, except ``slow_regex``, which waits for ``gate`` first."""

    def __init__(self, backend, gate: threading.Event, slow_regex: str) -> None:
        self._backend, self._gate, self._slow_regex = backend, gate, slow_regex
        self.name, self.vocab_size = backend.name, backend.vocab_size

    def unsupported_reason(self, spec):
        return self._backend.unsupported_reason(spec)

    def compile(self, spec):
        if spec.text == self._slow_regex:
            assert self._gate.wait(60)
        return self._backend.compile(spec)


def test_a_grammar_slow_to_compile_holds_back_no_other_request(llm, monkeypatch):
    engine = llm.llm_engine
    pool = engine.processor.grammar_pool
    gate = threading.Event()
    slow_regex = "slow-[0-9]{2}"
    monkeypatch.setattr(pool, "backend", _GatedBackend(pool.backend, gate, slow_regex))
    monkeypatch.setattr(processor_module, "GRAMMAR_VALIDATE_WAIT_S", 0.05)
    engine.add_request("slow", "Hello", greedy(StructuredOutputsParams(regex=slow_regex)))
    engine.add_request("free", "The quick brown fox", SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("constrained", "A", greedy(constraint("choice")))
    finished = {}
    while "free" not in finished or "constrained" not in finished:
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    slow = engine.scheduler.requests["slow"]
    assert "slow" not in finished and slow.status == RequestStatus.WAITING and slow.num_computed_tokens == 0
    assert engine.get_stats().num_kv_blocks_in_use == 0   # the waiting request holds nothing
    check_text("choice", finished["constrained"].outputs[0].text)
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert re.fullmatch(slow_regex, finished["slow"].outputs[0].text)
    assert_idle(llm)


class _CountingTracker:
    """A reasoning tracker whose reasoning ends after ``num_tokens`` tokens (``ReasoningTokenTracker``'s
    interface, for a model that writes no think tags)."""

    def __init__(self, num_tokens: int) -> None:
        self.state = ReasoningState.IN
        self.tag_ids = ThinkTagIds(start=1, end=2)
        self._left = num_tokens

    @property
    def reasoning_ended(self) -> bool:
        return self.state is ReasoningState.AFTER

    def feed(self, token_ids) -> bool:
        for _ in token_ids:
            if self.reasoning_ended:
                break
            self._left -= 1
            if self._left == 0:
                self.state = ReasoningState.AFTER
        return self.reasoning_ended


def test_reasoning_hook_starts_the_grammar_after_the_reasoning(llm, monkeypatch):
    num_reasoning = 3
    free, = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=num_reasoning), use_tqdm=False)
    monkeypatch.setattr(llm.llm_engine.scheduler, "new_reasoning_tracker",
                        lambda request: _CountingTracker(num_reasoning))
    out, = llm.generate(["Hello"], greedy(StructuredOutputsParams(choice=list(CHOICES))), use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert ids[:num_reasoning] == free.outputs[0].token_ids   # unconstrained while reasoning
    assert out.outputs[0].finish_reason == "stop"
    assert llm.get_tokenizer().decode(ids[num_reasoning:], skip_special_tokens=True) in CHOICES
    assert_idle(llm)


def test_min_tokens_with_a_grammar_that_can_only_end(llm):
    """min_tokens beyond what the grammar allows: the grammar's end (EOS) is sampled, never a row of -inf."""
    out, = llm.generate(["Hello"], greedy(StructuredOutputsParams(choice=["yes"]), min_tokens=20),
                        use_tqdm=False)
    assert out.outputs[0].text == "yes" and out.outputs[0].finish_reason == "stop"
    assert_idle(llm)


def test_a_choice_of_the_unconstrained_text_gives_its_tokens(llm):
    """A choice list holding the unconstrained greedy text (where that text is clean: no replacement or
    control characters): the constrained request gives the same tokens."""
    outs = llm.generate(TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    tok = llm.get_tokenizer()
    # Clean: every token's bytes are in the text (an incomplete UTF-8 tail is held back from it, and the
    # grammar could then end before the tail's tokens).
    clean = [(p, o.outputs[0]) for p, o in zip(TINY_PROMPTS, outs)
             if o.outputs[0].text.isprintable() and "\ufffd" not in o.outputs[0].text
             and tok.decode(o.outputs[0].token_ids) == o.outputs[0].text]
    assert clean
    constrained = llm.generate([p for p, _ in clean],
                               [SamplingParams(temperature=0, max_tokens=6,
                                               structured_outputs=StructuredOutputsParams(
                                                   choice=[c.text, c.text + "!"])) for _, c in clean],
                               use_tqdm=False)
    for (_, ref), out in zip(clean, constrained):
        assert out.outputs[0].token_ids == ref.token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_host_schedules_and_prepares_the_next_step_before_the_bitmask(tiny_llama_dir, monkeypatch,
                                                                        async_scheduling):
    """Async scheduling: a constrained step samples once the next step is scheduled and its inputs are
    prepared, so the host work of both overlaps the device's forward and the next forward follows the
    sampling at once. Without async scheduling each step fills its own bitmask before the next is
    scheduled. Both give the same tokens."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    events: list[str] = []

    def record(obj, name: str) -> None:
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            events.append(name)
            return original(*args, **kwargs)
        monkeypatch.setattr(obj, name, wrapped)
    record(engine.scheduler, "schedule")
    record(engine.scheduler, "grammar_bitmask")
    record(engine.runner.buffers, "prepare")
    out = llm.generate([TINY_PROMPTS[0]], greedy(constraint("regex")), use_tqdm=False)
    check_text("regex", out[0].outputs[0].text)
    steps = [e for e in events if e != "schedule"]   # the steps that ran: prepare, then its bitmask
    if async_scheduling:
        assert events[:5] == ["schedule", "prepare", "schedule", "prepare", "grammar_bitmask"], events
        assert steps[1:-1:2] == ["prepare"] * len(steps[1:-1:2]) and steps[2::2] == ["grammar_bitmask"] * len(steps[2::2]), steps
    else:
        assert events[:4] == ["schedule", "prepare", "grammar_bitmask", "schedule"], events
    # Async: the step launched after the last token's also asks for its (then empty) bitmask.
    assert steps.count("grammar_bitmask") == len(out[0].outputs[0].token_ids) + async_scheduling
    assert_idle(llm)
