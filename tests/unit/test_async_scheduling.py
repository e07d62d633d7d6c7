"""Async scheduling: the scheduler runs one step ahead with output placeholders.

``AsyncFakeRunner`` drives it the way ``LLMEngine.step`` does with async scheduling: schedule and
"launch" step N+1 before step N's output reaches ``update_from_output``. Tokens come from
``token_fn(req_id, output_index)``, so the outputs must equal a synchronous run's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.outputs import ModelRunnerOutput, SchedulerOutput
from tests.unit.fakes import EOS, FakeRunner, assert_no_leaks, default_token, make_request, make_scheduler


@dataclass
class _Row:
    num_tokens: int
    """Prompt + outputs sampled so far, including any whose id the scheduler has not seen."""
    num_prompt_tokens: int
    num_computed_tokens: int


class AsyncFakeRunner:
    """Keeps rows from the step diffs; samples for rows whose computed count reaches their tokens."""

    def __init__(self, scheduler, token_fn=default_token) -> None:
        self.scheduler = scheduler
        self.token_fn = token_fn
        self.rows: dict[str, _Row] = {}
        self.num_placeholder_steps = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.rows[nr.req_id] = _Row(len(nr.all_token_ids), nr.num_prompt_tokens, nr.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            assert self.rows[rid].num_computed_tokens == cached.num_computed_tokens[i]
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            request = self.scheduler.requests.get(rid)
            if request is not None and row.num_computed_tokens + n > request.num_tokens:
                self.num_placeholder_steps += 1     # an input id the scheduler has not seen yet
            row.num_computed_tokens += n
            assert row.num_computed_tokens <= row.num_tokens
            req_ids.append(rid)
            if row.num_computed_tokens == row.num_tokens:
                sampled.append([self.token_fn(rid, row.num_tokens - row.num_prompt_tokens)])
                row.num_tokens += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def run(self, max_steps: int = 10_000) -> dict[str, list]:
        sched = self.scheduler
        in_flight = None
        outs: dict[str, list] = {}
        for _ in range(max_steps):
            if not sched.has_unfinished_requests() and in_flight is None:
                return outs
            so = sched.schedule()
            result = self.execute(so)
            done = [in_flight] if in_flight is not None else []
            in_flight = None
            if so.total_num_scheduled_tokens:
                in_flight = (so, result)
            else:
                done.append((so, result))
            for step in done:
                for o in sched.update_from_output(*step):
                    outs.setdefault(o.req_id, []).append(o)
        raise AssertionError("not done")


def _tokens(outs):
    return {rid: ([t for o in lst for t in o.new_token_ids], lst[-1].finish_reason)
            for rid, lst in outs.items()}


def _run_both(make_reqs, token_fn=default_token, **sched_kw):
    sync_sched, async_sched = make_scheduler(**sched_kw), make_scheduler(**sched_kw)
    for r in make_reqs():
        sync_sched.add_request(r)
    for r in make_reqs():
        async_sched.add_request(r)
    sync_out = FakeRunner(sync_sched, token_fn=token_fn).run()
    runner = AsyncFakeRunner(async_sched, token_fn)
    async_out = runner.run()
    assert_no_leaks(sync_sched)
    assert_no_leaks(async_sched)
    return _tokens(sync_out), _tokens(async_out), runner, sync_sched, async_sched


@pytest.mark.parametrize("budget", [64, 7])
def test_same_outputs_as_sync(budget):
    def reqs():
        return [make_request(f"r{i}", prompt_len=3 + 5 * i, max_tokens=1 + 3 * i, ignore_eos=True)
                for i in range(6)]
    sync, asyn, runner, s1, s2 = _run_both(reqs, max_num_batched_tokens=budget)
    assert sync == asyn
    assert all(len(toks) == 1 + 3 * int(rid[1:]) for rid, (toks, _) in asyn.items())
    assert runner.num_placeholder_steps > 0
    # One step ahead costs no extra steps when requests end by length.
    assert s2.num_steps <= s1.num_steps + 1


def test_eos_drops_the_token_computed_one_step_ahead():
    def token_fn(rid, i):
        return EOS if (rid == "a" and i == 2) else 1000 + i

    def reqs():
        return [make_request("a", prompt_len=5, max_tokens=10), make_request("b", prompt_len=6, max_tokens=6)]
    sync, asyn, *_ = _run_both(reqs, token_fn=token_fn)
    assert sync == asyn
    assert asyn["a"] == ([1000, 1001, EOS], "stop")


def test_preemption_with_tokens_in_flight():
    def reqs():
        return [make_request(f"p{i}", prompt_len=6 + i, max_tokens=8, ignore_eos=True) for i in range(5)]
    sync, asyn, runner, s1, s2 = _run_both(reqs, num_blocks=9, block_size=4)
    assert sync == asyn
    assert s2.get_stats().num_preemptions > 0


def test_preempted_request_finished_by_its_in_flight_token():
    """Preempted in schedule(N+1), then step N's token is EOS: it leaves the waiting queue."""
    sched = make_scheduler(num_blocks=7, block_size=4)      # 6 usable blocks
    runner = AsyncFakeRunner(sched, token_fn=lambda rid, i: EOS if rid == "C" else 1000 + i)
    for rid, n in (("A", 8), ("B", 7), ("C", 6)):
        sched.add_request(make_request(rid, prompt_len=n, max_tokens=5))
    so1 = sched.schedule()                  # prefills: A 2 blocks, B 2, C 2 -> pool full
    out1 = runner.execute(so1)
    so2 = sched.schedule()                  # A needs a 3rd block: C (last) is preempted, token in flight
    assert so2.preempted_req_ids == {"C"}
    assert sched.requests["C"].num_output_placeholders == 1
    out2 = runner.execute(so2)
    sched.update_from_output(so1, out1)     # C's token (EOS) arrives while C is waiting
    assert "C" not in sched.requests and all(r.request_id != "C" for r in sched.waiting)
    sched.update_from_output(so2, out2)
    outs = runner.run()
    assert all(lst[-1].finished for lst in outs.values())
    assert_no_leaks(sched)


def test_max_tokens_one_is_not_scheduled_twice():
    sched = make_scheduler()
    runner = AsyncFakeRunner(sched)
    sched.add_request(make_request("x", prompt_len=4, max_tokens=1))
    so1 = sched.schedule()
    out1 = runner.execute(so1)
    so2 = sched.schedule()
    assert so2.total_num_scheduled_tokens == 0      # its in-flight token is its last
    outs = sched.update_from_output(so1, out1)
    assert outs[0].new_token_ids == [1000] and outs[0].finish_reason == "length"
    assert sched.requests == {}
