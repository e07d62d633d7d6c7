"""The one engine loop (``EngineCore.run``) over a scripted channel, and its messages."""

from __future__ import annotations

import pickle
from typing import Optional, get_args

import pytest

from engine.arg_utils import EngineArgs
from engine.core_messages import (AbortRequests, AddLoRA, AddRequest, AlignmentScores, CallEngine, CallResult,
                                  EngineCall, EngineCommand, EngineCoreOutputs, EngineDead, GetStats, InjectFault,
                                  ListLoRAs, RemoveLoRA, ResetPrefixCache, Shutdown)
from engine.engine_core import EngineCore
from engine.outputs import EngineCoreOutput, LogprobsLists, SchedulerStats
from engine.sampling_params import SamplingParams
from lora.request import LoRARequest


class ScriptedChannel:
    """Hands out ``commands`` in order; a blocking get with none left is the client leaving."""

    def __init__(self, commands: list[EngineCommand]) -> None:
        self.commands = list(commands)
        self.messages: list = []

    def get(self, block: bool) -> Optional[EngineCommand]:
        if self.commands:
            return self.commands.pop(0)
        return Shutdown() if block else None

    def put(self, message) -> None:
        self.messages.append(message)


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return EngineCore.from_engine_args(EngineArgs.from_kwargs(model=str(tiny_llama_dir), max_model_len=256))


def _add(core: EngineCore, request_id: str, max_tokens: int, n: int = 1) -> AddRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)
    _, children = core.facts.processor.process(request_id, "The quick brown fox", params)
    return AddRequest(request_id, children)


def test_outputs_message_round_trips_through_pickle_as_columns():
    lp = LogprobsLists(token_ids=[[5, 6]], logprobs=[[-0.1, -2.0]], ranks=[1])
    msg = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [1, 2]), EngineCoreOutput("b", [3], new_logprobs=lp),
                 EngineCoreOutput("c", [], new_prompt_logprobs=lp, num_cached_tokens=16),
                 EngineCoreOutput("d", [4], finish_reason="stop", stop_reason="##")],
        stats=SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5), rejected={"x": ValueError("bad")})
    back = pickle.loads(pickle.dumps(msg))
    assert back.outputs == msg.outputs and back.stats == msg.stats
    assert list(back.rejected) == ["x"] and str(back.rejected["x"]) == "bad"
    # No per-entry objects in the pickle: 256 plain outputs stay small.
    many = EngineCoreOutputs([EngineCoreOutput(f"cmpl-{i}", [i]) for i in range(256)])
    assert b"EngineCoreOutput\n" not in pickle.dumps(many, protocol=0)


def test_one_loop_runs_commands_steps_and_replies(core):
    channel = ScriptedChannel([
        _add(core, "r1", 6), _add(core, "r2", 4, n=2), _add(core, "r1", 3),   # the last one: a duplicate id
        CallEngine(1, ListLoRAs()), CallEngine(2, "step"), AbortRequests(["r2#0"]),
    ])
    core.run(channel)
    replies = {m.call_id: m for m in channel.messages if isinstance(m, CallResult)}
    assert replies[1].value == [] and replies[1].error is None
    assert isinstance(replies[2].error, TypeError)           # only EngineCalls, told apart by type
    steps = [m for m in channel.messages if isinstance(m, EngineCoreOutputs)]
    assert all(m.stats is not None for m in steps)
    rejected = {rid: e for m in steps for rid, e in m.rejected.items()}
    assert list(rejected) == ["r1"] and isinstance(rejected["r1"], ValueError)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for m in steps:
        for o in m.outputs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.req_id] = o.finish_reason
    assert len(tokens["r1"]) == 6 and finish["r1"] == "length"
    assert len(tokens["r2#1"]) == 4 and finish["r2#1"] == "length"
    assert "r2#0" not in finish                                 # aborted: the client already knows
    assert not core.has_unfinished_requests() and core.get_stats().kv_cache_usage == 0.0


def test_an_escaping_error_ends_the_loop_with_engine_dead(core):
    channel = ScriptedChannel([_add(core, "f", 50), InjectFault(RuntimeError("boom"))])
    core.run(channel)
    assert isinstance(channel.messages[-1], EngineDead) and "boom" in channel.messages[-1].message
    core.abort_requests(["f"])   # leave the module's core clean


def test_every_engine_call_is_a_typed_command_and_anything_else_is_refused(core):
    """Each ``EngineCall`` has its case in ``EngineCore.call`` (a call without one would raise
    AssertionError) and travels pickled (engine process); names, classes and other commands are refused."""
    calls = {AddLoRA: AddLoRA(LoRARequest("a", 1, "/no/such/dir")), RemoveLoRA: RemoveLoRA("a"),
             ListLoRAs: ListLoRAs(), ResetPrefixCache: ResetPrefixCache(), GetStats: GetStats(),
             AlignmentScores: AlignmentScores(None, (1, 2), 1)}
    assert set(calls) == set(get_args(EngineCall))
    answers = {}
    for kind, call in calls.items():
        assert pickle.loads(pickle.dumps(CallEngine(7, call))).call == call
        reply = core.handle(CallEngine(7, call), {})
        assert isinstance(reply, CallResult) and reply.call_id == 7
        answers[kind] = reply
    assert isinstance(answers[AddLoRA].error, ValueError)    # a core without LoRA says so
    assert answers[RemoveLoRA].value is False and answers[ListLoRAs].value == []
    assert answers[ResetPrefixCache].value is True and answers[GetStats].value == core.get_stats()
    assert isinstance(answers[AlignmentScores].error, ValueError)   # word timestamps need Whisper
    for not_a_call in ("get_stats", GetStats, Shutdown(), AbortRequests([])):
        reply = core.handle(CallEngine(8, not_a_call), {})
        assert isinstance(reply.error, TypeError) and "not an engine call" in str(reply.error)
