"""StructuredOutputManager: the scheduler's view of constrained requests (grammar readiness, the step
bitmask, accepting sampled tokens, termination, rollback), and a batch of constrained and free requests
decoded together by a random-logits model through the bitmask kernels."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.structured_output.bitmask import apply_token_bitmask, unpack_bitmask
from engine.structured_output.compiler import GrammarCompilePool
from engine.structured_output.manager import AcceptStatus, GrammarStatus, StructuredOutputManager
from engine.structured_output.params import StructuredOutputsParams
from tests.structured_output.utils import HeldPool, eos, ids, tiny_tokenizer

VOCAB_SIZE = 400
"""Logits width of the tiny model: past its tokenizer's 384 ids (padding never allowed)."""


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def pool(request):
    pool = GrammarCompilePool.for_tokenizer(tiny_tokenizer(), VOCAB_SIZE, backend=request.param)
    yield pool
    pool.shutdown()


def test_requests_wait_for_their_grammar(pool):
    held = HeldPool(pool)
    manager = StructuredOutputManager(held, max_num_seqs=4)
    manager.add_request("r1", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request("bad", StructuredOutputsParams(regex="(a"))
    assert manager.poll("r1") is GrammarStatus.COMPILING and not manager.is_ready("r1")
    assert manager.is_ready("free") and not manager.is_constrained("free")
    with pytest.raises(ValueError, match="already has a grammar"):
        manager.add_request("r1", StructuredOutputsParams(regex="a"))
    held.release()
    assert manager.poll("r1") is GrammarStatus.READY and manager.is_ready("r1")
    assert manager.poll("bad") is GrammarStatus.FAILED and not manager.is_ready("bad")
    assert "not closed" in str(manager.error("bad")) or "unclosed" in str(manager.error("bad"))
    manager.free("bad")
    assert manager.num_requests() == 1 and manager.error("bad") is None


def test_step_bitmask_accept_terminate_and_rollback(pool):
    manager = StructuredOutputManager(pool, max_num_seqs=4)
    manager.add_request("c", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request("r", StructuredOutputsParams(regex="[0-9]+"))
    pool.submit(StructuredOutputsParams(regex="[0-9]+")).result()
    pool.submit(StructuredOutputsParams(choice=["yes", "no"])).result()
    assert manager.is_ready("c") and manager.is_ready("r")

    grammar = manager.fill_bitmask([("free", 0), ("c", 1), ("r", 3)])
    assert grammar.row_indices == [1, 3] and grammar.bitmask.shape == (4, 13)
    allowed = unpack_bitmask(grammar.bitmask, VOCAB_SIZE)  # [4, V]
    assert not allowed[[1, 3], 384:].any()  # padding ids past the tokenizer: never allowed
    first_c = {tiny_tokenizer().decode([t]) for t in allowed[1].nonzero().flatten().tolist()}
    assert first_c and all("yes".startswith(s) or "no".startswith(s) for s in first_c)
    assert manager.fill_bitmask([("free", 0)]) is None

    yes = ids("yes")
    assert manager.accept_tokens("c", yes) is AcceptStatus.ACCEPTED
    assert manager.accept_tokens("c", ids("x")) is AcceptStatus.REJECTED
    assert manager.num_accepted_tokens("c") == len(yes)
    assert manager.accept_tokens("c", [eos()]) is AcceptStatus.TERMINATED and manager.is_terminated("c")
    assert manager.accept_tokens("c", [5]) is AcceptStatus.TERMINATED  # past the end: counted, not fed
    assert manager.num_accepted_tokens("c") == len(yes) + 2
    manager.rollback_to("c", len(yes))  # e.g. a discarded in-flight step
    assert not manager.is_terminated("c") and manager.num_accepted_tokens("c") == len(yes)
    only_stop = unpack_bitmask(manager.fill_bitmask([("c", 0)]).bitmask[:1], VOCAB_SIZE)[0]
    assert only_stop.nonzero().flatten().tolist() == [eos()]
    manager.rollback("c", len(yes))
    assert manager.num_accepted_tokens("c") == 0
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        manager.rollback("c", 1)

    assert manager.accept_tokens("r", ids("12") + ids("3")) is AcceptStatus.ACCEPTED
    manager.free("r")
    assert not manager.is_constrained("r") and manager.fill_bitmask([("r", 0)]) is None


def test_a_mixed_batch_decodes_through_the_kernels(pool):
    """Three constrained requests and a free one share each step's logits; the constrained rows sample
    only what their grammars allow, the free row is untouched."""
    tok = tiny_tokenizer()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}
    specs = {"json": StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                             disable_additional_properties=True),
             "regex": StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{1,3}"),
             "choice": StructuredOutputsParams(choice=["alpha", "beta"])}
    manager = StructuredOutputManager(pool, max_num_seqs=8)
    for req_id, params in specs.items():
        manager.add_request(req_id, params)
        pool.submit(params).result()  # the scheduler would skip the request until then
    rows = {"free": 0, "json": 1, "regex": 2, "choice": 3}
    outputs: dict[str, list[int]] = {r: [] for r in rows}
    generator = torch.Generator().manual_seed(0)
    live = set(specs)
    for _ in range(200):
        if not live:
            break
        assert all(manager.is_ready(r) for r in live)
        grammar = manager.fill_bitmask([(r, rows[r]) for r in ["free", *sorted(live)]])
        logits = torch.randn(4, VOCAB_SIZE, generator=generator)  # [4, V]
        free_before = logits[0].clone()
        apply_token_bitmask(logits, grammar.bitmask, grammar.row_indices)
        assert torch.equal(logits[0], free_before)
        sampled = logits.argmax(dim=-1).tolist()
        for req_id in list(live):
            token = sampled[rows[req_id]]
            outputs[req_id].append(token)
            status = manager.accept_tokens(req_id, [token])
            assert status is not AcceptStatus.REJECTED
            if status is AcceptStatus.TERMINATED:
                live.discard(req_id)
                manager.free(req_id)
    assert not live and manager.num_requests() == 0
    text = {r: tok.decode(outputs[r][:-1]) for r in specs}
    assert all(outputs[r][-1] == eos() for r in specs)
    value = json.loads(text["json"])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", text["regex"]), text["regex"]
    assert text["choice"] in ("alpha", "beta")
