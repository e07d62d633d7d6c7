"""The engine's constrained-decoding hooks without a model: the scheduler (a request waits for its grammar
without holding back others, a failed compile or a rejected token ends only that request, a grammar that
ends finishes its request, the step names its constrained sampling rows), the sampler (the mask, min_tokens
against a grammar that can only end, raw logprobs without the mask) and the manager's reasoning gate."""

from __future__ import annotations


import pytest
import torch

from engine.outputs import ModelRunnerOutput
from engine.reasoning.parser import ReasoningState, ThinkTagIds
from engine.reasoning.think_tags import ReasoningTokenTracker
from engine.request import EngineRequest, Request, RequestStatus
from engine.sampler import Sampler, TokenBitmask
from engine.sampling_metadata import build_sampling_metadata
from engine.sampling_params import SamplingParams
from engine.structured_output.bitmask import allocate_bitmask, unpack_bitmask
from engine.structured_output.compiler import GrammarCompilePool
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.manager import AcceptStatus, StructuredOutputManager
from engine.structured_output.params import StructuredOutputsParams
from tests.structured_output.utils import HeldPool, eos, ids, tiny_tokenizer
from tests.unit.fakes import make_scheduler

VOCAB_SIZE = 400
"""Logits width of the tiny model: past its tokenizer's 384 ids."""


@pytest.fixture(scope="module")
def pool():
    pool = GrammarCompilePool.for_tokenizer(tiny_tokenizer(), VOCAB_SIZE, "auto", [eos()])
    yield pool
    pool.shutdown()


def request(req_id: str, structured_outputs=None, prompt_len: int = 8, max_tokens: int = 8,
            min_tokens: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            structured_outputs=structured_outputs)
    return Request(EngineRequest(request_id=req_id, prompt=None,
                                 prompt_token_ids=list(range(10, 10 + prompt_len)), sampling_params=params,
                                 eos_token_ids={eos()}, max_tokens=max_tokens))


def scheduler_with(manager_pool, **kwargs):
    sched = make_scheduler(**kwargs)
    sched.structured_output = StructuredOutputManager(manager_pool, max_num_seqs=16)
    return sched


def sampled(so, tokens: dict[str, int]) -> ModelRunnerOutput:
    """The step's output: ``tokens[req_id]`` for the scheduled requests that sample."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids,
                             sampled_token_ids=[[tokens[r]] if r in tokens else [] for r in req_ids])


def test_a_request_waits_for_its_grammar_and_holds_back_no_one(pool):
    held = HeldPool(pool)
    sched = scheduler_with(held)
    sched.add_request(request("slow", StructuredOutputsParams(choice=["yes", "no"])))
    sched.add_request(request("free"))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"free"} and not so.structured_output_req_ids
    assert sched.requests["slow"].status == RequestStatus.WAITING
    assert sched.kv_cache_manager.get_block_ids("slow") == []   # it holds nothing while it waits
    sched.update_from_output(so, sampled(so, {"free": 300}))
    held.release()
    so = sched.schedule()
    assert "slow" in so.num_scheduled_tokens and so.structured_output_req_ids == frozenset({"slow"})
    bitmask = sched.grammar_bitmask(["free", "slow"])   # logits rows: free 0, slow 1
    assert bitmask.row_indices == [1]
    allowed = unpack_bitmask(bitmask.bitmask, VOCAB_SIZE)[1].nonzero().flatten().tolist()
    assert ids("yes")[0] in allowed and ids("no")[0] in allowed and eos() not in allowed


def test_partial_prefill_chunk_has_no_constrained_row(pool):
    sched = scheduler_with(pool, max_num_batched_tokens=4)
    sched.add_request(request("r", StructuredOutputsParams(regex="a+"), prompt_len=6))
    sched.structured_output.wait_for_compilation(30)
    so = sched.schedule()
    assert so.num_scheduled_tokens["r"] == 4 and not so.structured_output_req_ids
    sched.update_from_output(so, sampled(so, {}))
    so = sched.schedule()
    assert so.num_scheduled_tokens["r"] == 2 and so.structured_output_req_ids == frozenset({"r"})


def test_failed_compile_ends_only_its_request(pool):
    held = HeldPool(pool)
    sched = scheduler_with(held)
    sched.add_request(request("bad", StructuredOutputsParams.from_response_format(
        {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})))
    sched.add_request(request("free"))
    held.release()
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"free"} and "bad" not in sched.requests
    failed = sched.take_failed()
    assert set(failed) == {"bad"} and isinstance(failed["bad"], StructuredOutputError)
    assert failed["bad"].param == "response_format" and str(failed["bad"]).startswith("response_format: ")
    assert sched.structured_output.num_requests() == 0 and sched.take_failed() == {}


def test_grammar_end_finishes_the_request_even_under_min_tokens(pool):
    sched = scheduler_with(pool)
    sched.add_request(request("r", StructuredOutputsParams(choice=["yes"]), min_tokens=6))
    sched.structured_output.wait_for_compilation(30)
    outputs = []
    for token in ids("yes") + [eos()]:
        so = sched.schedule()
        outputs += sched.update_from_output(so, sampled(so, {"r": token}))
    assert outputs[-1].finish_reason == "stop" and outputs[-1].new_token_ids == [eos()]
    assert not sched.requests and sched.structured_output.num_requests() == 0


def test_rejected_token_ends_the_request_with_an_error(pool):
    sched = scheduler_with(pool)
    sched.add_request(request("r", StructuredOutputsParams(choice=["yes"])))
    sched.add_request(request("free"))
    sched.structured_output.wait_for_compilation(30)
    so = sched.schedule()
    outputs = sched.update_from_output(so, sampled(so, {"r": ids("no")[0], "free": 7}))
    assert [o.req_id for o in outputs] == ["free"]   # the failed request gets no output
    failed = sched.take_failed()
    assert set(failed) == {"r"} and "does not allow" in str(failed["r"])
    assert "r" not in sched.requests and sched.structured_output.num_requests() == 0
    assert sched.kv_cache_manager.num_free_blocks + len(sched.kv_cache_manager.get_block_ids("free")) \
        == sched.kv_cache_manager.num_usable_blocks


def test_engine_without_constrained_decoding_refuses_the_request():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="structured_outputs: this engine has no constrained decoding"):
        sched.add_request(request("r", StructuredOutputsParams(regex="a")))
    assert not sched.requests


# ------------------------------------------------------------------------------------------ sampler
def _meta(params, outputs=None):
    outputs = outputs or [[] for _ in params]
    return build_sampling_metadata(params, [None] * len(params), [[] for _ in params], outputs,
                                   [{2} for _ in params], 64, torch.device("cpu"))


def _row_allowing(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    bitmask[row].zero_()
    for t in token_ids:
        word, bit = divmod(t, 32)
        value = 1 << bit
        bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value


def test_sampler_masks_only_the_constrained_rows():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    bitmask = allocate_bitmask(3, 64, pin_memory=False)
    _row_allowing(bitmask, 0, [5, 40])
    _row_allowing(bitmask, 2, [63])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    out = Sampler()(logits, _meta(params), token_bitmask=TokenBitmask(bitmask, [0, 2]))
    assert out.sampled_token_id_list[0] == (5 if logits[0, 5] > logits[0, 40] else 40)
    assert out.sampled_token_id_list[1] == int(logits[1].argmax())
    assert out.sampled_token_id_list[2] == 63


def test_min_tokens_never_empties_a_row_whose_grammar_can_only_end():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    bitmask = allocate_bitmask(2, 64, pin_memory=False)
    _row_allowing(bitmask, 0, [2])        # only EOS: min_tokens must not mask it
    _row_allowing(bitmask, 1, [2, 9])     # EOS or 9: min_tokens masks EOS
    params = [SamplingParams(temperature=0, min_tokens=5), SamplingParams(temperature=0, min_tokens=5)]
    out = Sampler()(logits, _meta(params), token_bitmask=TokenBitmask(bitmask, [0, 1]))
    assert out.sampled_token_id_list == [2, 9]
    random_params = [SamplingParams(temperature=1.0, min_tokens=5, seed=3)] * 2
    out = Sampler()(logits, _meta(random_params), token_bitmask=TokenBitmask(bitmask, [0, 1]))
    assert out.sampled_token_id_list == [2, 9]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_are_raw_or_masked_by_mode(mode):
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    bitmask = allocate_bitmask(1, 64, pin_memory=False)
    _row_allowing(bitmask, 0, [3, 4])
    params = [SamplingParams(temperature=0, logprobs=4)]
    meta = build_sampling_metadata(params, [None], [[]], [[]], [{2}], 64, torch.device("cpu"), mode)
    out = Sampler()(logits, meta, token_bitmask=TokenBitmask(bitmask, [0]))
    token = out.sampled_token_id_list[0]
    assert token in (3, 4)
    raw = logits[0].log_softmax(-1)
    if mode == "raw_logprobs":
        assert out.logprobs.logprobs[0][0] == pytest.approx(float(raw[token]), abs=1e-5)
        assert out.logprobs.token_ids[0][1] == int(raw.argmax())   # the model's top token, masked or not
    else:
        assert out.logprobs.logprobs[0][0] == pytest.approx(float(raw[[3, 4]].log_softmax(-1)[token - 3]),
                                                             abs=1e-5)
        assert set(out.logprobs.token_ids[0][1:3]) == {3, 4}
        assert out.logprobs.logprobs[0][3] == float("-inf")


# ------------------------------------------------------------------------------------------ reasoning
def test_reasoning_gate_of_the_manager(pool):
    """With a reasoning tracker: in BEFORE the grammar's first tokens and the opening tag are allowed; the
    reasoning is unconstrained; after the closing tag the grammar applies, and it counts in every token."""
    start, end = ids("<|im_start|>")[0], tiny_tokenizer().convert_tokens_to_ids("<image>")
    manager = StructuredOutputManager(pool, max_num_seqs=2)
    tracker = ReasoningTokenTracker(ThinkTagIds(start=start, end=end), ReasoningState.BEFORE)
    manager.add_request("r", StructuredOutputsParams(choice=["yes"]), reasoning=tracker)
    manager.wait_for_compilation(30)
    assert manager.is_ready("r")

    def allowed() -> set[int]:
        grammar = manager.fill_bitmask([("r", 0)])
        return set(unpack_bitmask(grammar.bitmask, VOCAB_SIZE)[0].nonzero().flatten().tolist())

    first = allowed()
    assert start in first and ids("yes")[0] in first and ids("no")[0] not in first
    assert manager.accept_tokens("r", [start]) is AcceptStatus.ACCEPTED and tracker.state is ReasoningState.IN
    assert len(allowed()) == VOCAB_SIZE   # everything while reasoning
    assert manager.accept_tokens("r", ids("no") + [end]) is AcceptStatus.ACCEPTED
    assert tracker.reasoning_ended and ids("no")[0] not in allowed() and ids("yes")[0] in allowed()
    assert manager.accept_tokens("r", ids("yes") + [eos()]) is AcceptStatus.TERMINATED
    assert manager.num_accepted_tokens("r") == 1 + len(ids("no")) + 1 + len(ids("yes")) + 1
    with pytest.raises(ValueError, match="after its reasoning"):
        manager.rollback("r", len(ids("yes")) + 2)

    # A reply that does not open reasoning: its first token is content, held to the grammar.
    direct = ReasoningTokenTracker(ThinkTagIds(start=start, end=end), ReasoningState.BEFORE)
    manager.add_request("d", StructuredOutputsParams(choice=["yes"]), reasoning=direct)
    manager.wait_for_compilation(30)
    assert manager.accept_tokens("d", ids("no")[:1]) is AcceptStatus.REJECTED
    assert direct.reasoning_ended
