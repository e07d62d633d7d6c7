"""The runner's request states and its steps' results (``engine.runner.state``, ``engine.runner.pending``):
reading a step's result changes nothing else, and the runner appends sampled ids to its requests itself, in
step order, keeping the newest step in flight until its ids are read."""

from __future__ import annotations

import torch

from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.runner.pending import PendingOutput
from engine.runner.state import RequestStates
from engine.sampling_params import SamplingParams


def _states(*req_ids: str) -> RequestStates:
    states = RequestStates(4, 8, 0, torch.device("cpu"), None, None)
    new = tuple(NewRequestData(req_id=r, all_token_ids=(1, 2, 3), num_prompt_tokens=3,
                               sampling_params=SamplingParams(), block_ids=(i + 1,), cross_block_ids=(),
                               num_computed_tokens=0) for i, r in enumerate(req_ids))
    states.apply(SchedulerOutput(new, CachedRequestData(), {r: 3 for r in req_ids}, 3 * len(req_ids)))
    return states


def test_get_reads_the_result_and_changes_no_request():
    states = _states("a", "b")
    a, b = states.requests["a"], states.requests["b"]
    pending = PendingOutput(["a", "b"], ["b"], torch.tensor([7]), None)
    out = pending.get()
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[], [7]]
    assert pending.get() is out and pending.resolved
    assert a.token_ids == [1, 2, 3] and b.token_ids == [1, 2, 3]


def test_sampled_ids_reach_their_requests_in_step_order():
    states = _states("a")
    a = states.requests["a"]
    first, second = PendingOutput(["a"], ["a"], [10], None), PendingOutput(["a"], ["a"], [11], None)
    states.track(first, [a])
    states.track(second, [a])
    second.get()                              # read out of order: the runner still appends in step order
    states.absorb_sampled(keep_last=True)     # the newest was read: nothing stays in flight
    assert a.token_ids == [1, 2, 3, 10, 11]
    states.absorb_sampled()
    assert a.token_ids == [1, 2, 3, 10, 11]


def test_the_newest_unread_step_stays_in_flight_until_asked_for():
    states = _states("a")
    a = states.requests["a"]
    states.track(PendingOutput(["a"], ["a"], [10], None), [a])
    states.track(PendingOutput(["a"], ["a"], [11], None), [a])
    states.absorb_sampled(keep_last=True)
    assert a.token_ids == [1, 2, 3, 10]
    states.absorb_sampled()                   # penalties need every token on the host
    assert a.token_ids == [1, 2, 3, 10, 11]


def test_a_done_step_has_its_output():
    out = PendingOutput.done(PendingOutput([], [], None, None).get())
    assert out.resolved and out.get().sampled_token_ids == []
