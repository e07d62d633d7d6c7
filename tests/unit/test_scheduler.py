"""Scheduler: budgets, chunked prefill, preemption, stops, aborts, leaks, priority, prefix hits.

``FakeRunner`` (tests/unit/fakes.py) re-checks every step message against the scheduler:
token budget, max_num_seqs, block tables == KV manager, ref counts == holders, computed counts.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import zlib

import pytest

from engine.outputs import LogprobsLists, ModelRunnerOutput
from engine.request import RequestStatus
from tests.unit.fakes import (EOS, FakeRunner, assert_no_leaks, lora, make_request, make_scheduler,
                              prompt_tokens)


def scheduled(so) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)


def new_ids(so) -> list[str]:
    return [r.req_id for r in so.scheduled_new_reqs]


# --------------------------------------------------------------------------------------
# Budgets and chunked prefill
# --------------------------------------------------------------------------------------
def test_chunked_prefill_of_long_prompt_mixed_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(make_request(f"s{i}", prompt_len=4, max_tokens=20))
    so = runner.step().scheduler_output
    assert scheduled(so) == {"s0": 4, "s1": 4, "s2": 4}
    sched.add_request(make_request("long", prompt_len=100, max_tokens=2))
    expected_long = [29, 29, 29, 13, 1]
    computed_before = [0, 29, 58, 87, 100]
    for step, (n, before) in enumerate(zip(expected_long, computed_before)):
        result = runner.step()
        so = result.scheduler_output
        assert scheduled(so) == {"s0": 1, "s1": 1, "s2": 1, "long": n}
        if step == 0:
            assert new_ids(so) == ["long"] and so.scheduled_new_reqs[0].num_computed_tokens == 0
        else:
            cached = so.scheduled_cached_reqs
            assert cached.req_ids == ("s0", "s1", "s2", "long")
            assert cached.num_computed_tokens[3] == before
        got_long_token = any(o.req_id == "long" and o.new_token_ids for o in result.outputs)
        assert got_long_token == (step >= 3)  # sampled only once the prompt is done


def test_long_prefill_token_threshold_caps_chunks():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", prompt_len=25, max_tokens=2))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=2))
    assert scheduled(runner.step().scheduler_output) == {"a": 10, "b": 3}
    assert scheduled(runner.step().scheduler_output) == {"a": 10, "b": 1}
    assert scheduled(runner.step().scheduler_output) == {"a": 5}


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", prompt_len=3, max_tokens=3))
    assert scheduled(runner.step().scheduler_output) == {"r0": 3, "r1": 3}
    runner.run()
    assert sched.get_stats().max_reqs_per_step == 2
    assert_no_leaks(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_respects_budgets_and_leaks_nothing(policy, seed):
    rng = random.Random(seed)
    sched = make_scheduler(max_num_batched_tokens=24, max_num_seqs=5, policy=policy, num_blocks=30,
                           long_prefill_token_threshold=rng.choice([0, 7]))
    runner = FakeRunner(
        sched, token_fn=lambda rid, i: EOS if (zlib.crc32(rid.encode()) + i) % 17 == 0 else 500 + i)
    shared = prompt_tokens("shared", 12)
    counter = 0
    expected: set[str] = set()

    def on_step(step: int) -> None:
        nonlocal counter
        if step < 120:
            for _ in range(rng.choice([0, 0, 1, 2])):
                prompt = (shared[:rng.randrange(13)] + prompt_tokens(f"p{counter}", rng.randrange(1, 40)))
                req = make_request(f"q{counter}", prompt_token_ids=prompt, max_tokens=rng.randrange(1, 20),
                                   priority=rng.randrange(3))
                sched.add_request(req)
                expected.add(req.request_id)
                counter += 1
        if step % 9 == 4 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            expected.discard(victim)

    outputs = runner.run(on_step=on_step, min_steps=120)
    finished = {rid for rid, outs in outputs.items() if outs[-1].finished}
    assert expected <= finished
    stats = sched.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_no_leaks(sched)


# --------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------
def test_fcfs_preempts_last_admitted_and_resumes_with_outputs():
    sched = make_scheduler(num_blocks=7)  # 6 usable blocks of 4 tokens
    runner = FakeRunner(sched)
    a = make_request("A", prompt_len=8, max_tokens=3)
    b = make_request("B", prompt_len=5, max_tokens=3)
    c = make_request("C", prompt_len=6, max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    assert scheduled(runner.step().scheduler_output) == {"A": 8, "B": 5, "C": 6}
    d = make_request("D", prompt_len=2, max_tokens=1)
    sched.add_request(d)

    so = runner.step().scheduler_output  # A needs a 3rd block: C (last admitted) is preempted
    assert so.preempted_req_ids == {"C"}
    assert scheduled(so) == {"A": 1, "B": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("C") == []
    assert list(sched.waiting) == [c, d]  # front of the queue; D not admitted in a preempting step
    assert sched.kv_cache_manager.num_free_blocks == 1

    so = runner.step().scheduler_output  # C does not fit yet and blocks D (fcfs)
    assert scheduled(so) == {"A": 1, "B": 1} and not so.preempted_req_ids
    assert a.is_finished() and b.is_finished()

    so = runner.step().scheduler_output
    assert so.finished_req_ids == {"A", "B"}
    assert new_ids(so) == ["C", "D"]
    resumed = so.scheduled_new_reqs[0]
    assert list(resumed.all_token_ids) == c.prompt_token_ids + [1000] and resumed.num_prompt_tokens == 6
    assert resumed.num_computed_tokens == 4  # its first block survived in the prefix cache
    assert scheduled(so) == {"C": 3, "D": 2}
    runner.run()
    assert c.output_token_ids == [1000, 1001, 1002]
    assert sched.get_stats().num_preemptions == 1
    assert_no_leaks(sched)


def test_preempted_request_recomputes_everything_without_prefix_caching():
    sched = make_scheduler(num_blocks=7, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    for rid, n in (("A", 8), ("B", 5), ("C", 6)):
        sched.add_request(make_request(rid, prompt_len=n, max_tokens=3))
    runner.step()
    assert runner.step().scheduler_output.preempted_req_ids == {"C"}
    for _ in range(3):
        so = runner.step().scheduler_output
        if "C" in new_ids(so):
            assert so.scheduled_new_reqs[0].num_computed_tokens == 0
            assert so.num_scheduled_tokens["C"] == 7
            break
    else:
        raise AssertionError("C never resumed")
    runner.run()
    assert_no_leaks(sched)


def test_priority_preempts_worst_priority_and_gives_back_its_tokens():
    sched = make_scheduler(policy="priority", num_blocks=5)  # 4 usable blocks
    runner = FakeRunner(sched)
    h1 = make_request("H1", prompt_len=3, max_tokens=4, priority=0)
    low = make_request("L", prompt_len=1, max_tokens=8, priority=9)
    h2 = make_request("H2", prompt_len=4, max_tokens=4, priority=1)
    sched.add_request(h1)
    runner.step()
    sched.add_request(low)
    runner.step()
    sched.add_request(h2)
    runner.step()
    assert [r.request_id for r in sched.running] == ["H1", "L", "H2"]
    assert sched.kv_cache_manager.num_free_blocks == 0

    # H2 needs a block: L (worst priority, before H2 in the list, already scheduled) goes,
    # and its token is given back.
    so = runner.step().scheduler_output
    assert so.preempted_req_ids == {"L"}
    assert scheduled(so) == {"H1": 1, "H2": 1} and so.total_num_scheduled_tokens == 2
    assert low.status == RequestStatus.PREEMPTED
    outputs = runner.run()
    assert low.request_id in outputs and outputs["L"][-1].finish_reason == "length"
    assert_no_leaks(sched)


def test_priority_self_preemption_lets_better_requests_run():
    sched = make_scheduler(policy="priority", num_blocks=4)  # 3 usable blocks
    runner = FakeRunner(sched)
    low = make_request("L", prompt_len=3, max_tokens=6, priority=5)
    sched.add_request(low)
    runner.step()  # L: 4 tokens, 1 block
    sched.add_request(make_request("H", prompt_len=7, max_tokens=2, priority=0))
    so = runner.step().scheduler_output  # L token 3; H admitted (2 blocks)
    assert scheduled(so) == {"L": 1, "H": 7}
    so = runner.step().scheduler_output  # L needs a 2nd block: it is the worst, preempts itself
    assert so.preempted_req_ids == {"L"} and scheduled(so) == {"H": 1}
    runner.run()
    assert low.output_token_ids == [1000 + i for i in range(6)]
    assert_no_leaks(sched)


def test_priority_policy_admission_order():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    runner = FakeRunner(sched)
    for rid, prio in (("p3", 3), ("p1a", 1), ("p2", 2), ("p1b", 1)):
        sched.add_request(make_request(rid, prompt_len=2, max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished_requests():
        order += new_ids(runner.step().scheduler_output)
    assert order == ["p1a", "p1b", "p2", "p3"]


def test_fcfs_admission_order():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    for rid, prio in (("a", 3), ("b", 1), ("c", 2)):
        sched.add_request(make_request(rid, prompt_len=2, max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished_requests():
        order += new_ids(runner.step().scheduler_output)
    assert order == ["a", "b", "c"]


# --------------------------------------------------------------------------------------
# Admission checks
# --------------------------------------------------------------------------------------
def test_request_that_can_never_fit_is_rejected_at_add():
    sched = make_scheduler(max_model_len=17)
    with pytest.raises(ValueError, match=r"17 tokens.*max_model_len=17"):
        sched.add_request(make_request("long", prompt_len=17, max_tokens=1))
    sched = make_scheduler(num_blocks=5, max_model_len=64)  # 4 blocks x 4 tokens
    with pytest.raises(ValueError) as err:
        sched.add_request(make_request("big", prompt_len=10, max_tokens=8))
    msg = str(err.value)
    assert "KV cache has 4 blocks of 4 tokens (16 tokens)" in msg and "needs up to 18 tokens" in msg
    assert "num_gpu_blocks_override" in msg and "max_tokens" in msg
    assert not sched.requests and len(sched.waiting) == 0
    # exactly fitting: 10 + 7 tokens, the last one never needs KV
    ok = make_request("ok", prompt_len=10, max_tokens=7, ignore_eos=True)
    sched.add_request(ok)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", prompt_len=2))
    FakeRunner(sched).run()
    assert ok.num_output_tokens == 7 and sched.get_stats().num_preemptions == 0
    assert_no_leaks(sched)
    # an unresolved max_tokens is capped by max_model_len: 17 tokens fit
    sched = make_scheduler(num_blocks=5, max_model_len=17)
    sched.add_request(make_request("capped", prompt_len=10, max_tokens=100))


def test_lora_request_rejected_without_lora_config():
    from tests.unit.fakes import lora
    sched = make_scheduler()
    with pytest.raises(ValueError, match="LoRA is disabled"):
        sched.add_request(make_request("x", lora_request=lora("a")))


# --------------------------------------------------------------------------------------
# Stop conditions
# --------------------------------------------------------------------------------------
def run_one(token_fn, max_model_len: int = 256, **kw):
    sched = make_scheduler(max_model_len=max_model_len)
    req = make_request("r", **kw)
    sched.add_request(req)
    outputs = FakeRunner(sched, token_fn=token_fn).run()["r"]
    assert_no_leaks(sched)
    return req, outputs[-1]


def test_stop_on_eos():
    req, last = run_one(lambda rid, i: EOS if i == 2 else 7, max_tokens=10)
    assert req.output_token_ids == [7, 7, EOS]
    assert (last.finish_reason, last.stop_reason, last.new_token_ids) == ("stop", None, [EOS])


def test_ignore_eos_runs_to_max_tokens():
    req, last = run_one(lambda rid, i: EOS, max_tokens=5, ignore_eos=True)
    assert req.output_token_ids == [EOS] * 5 and last.finish_reason == "length"


def test_min_tokens_defers_eos_and_stop_ids():
    req, last = run_one(lambda rid, i: EOS, max_tokens=10, min_tokens=3)
    assert req.output_token_ids == [EOS] * 3 and last.finish_reason == "stop"
    req, last = run_one(lambda rid, i: 77, max_tokens=10, min_tokens=2, stop_token_ids=[77])
    assert req.output_token_ids == [77, 77] and (last.finish_reason, last.stop_reason) == ("stop", 77)


def test_stop_token_ids_set_stop_reason():
    req, last = run_one(lambda rid, i: 77 if i == 1 else 5, max_tokens=10, stop_token_ids=[77, 78])
    assert req.output_token_ids == [5, 77] and (last.finish_reason, last.stop_reason) == ("stop", 77)
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_and_eos_on_the_last_token():
    req, last = run_one(lambda rid, i: 5, max_tokens=4)
    assert req.num_output_tokens == 4 and (last.finish_reason, last.stop_reason) == ("length", None)
    req, last = run_one(lambda rid, i: EOS if i == 3 else 5, max_tokens=4)
    assert last.finish_reason == "stop"  # EOS is checked before length


def test_max_model_len_caps_length():
    # max_tokens not resolved on purpose: the max_model_len check must stop it
    req, last = run_one(lambda rid, i: 5, max_model_len=12, prompt_len=8, max_tokens=100)
    assert req.num_tokens == 12 and req.num_output_tokens == 4 and last.finish_reason == "length"


# --------------------------------------------------------------------------------------
# Aborts and outputs
# --------------------------------------------------------------------------------------
def test_abort_frees_everything_and_is_reported_next_step():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", prompt_len=9, max_tokens=50) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    runner.step()
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING] * 2
    sched.finish_requests(["r0", "r2", "nope"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert reqs[0].status == reqs[2].status == RequestStatus.FINISHED_ABORTED
    assert reqs[0].get_finish_reason() == "abort" and reqs[0].finished_time is not None
    assert sched.kv_cache_manager.get_block_ids("r0") == []
    assert [r.request_id for r in sched.waiting] == ["r3"] and sched.get_num_unfinished_requests() == 2
    so = runner.step().scheduler_output
    assert so.finished_req_ids == {"r0", "r2"}
    assert new_ids(so) == ["r3"]
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert_no_leaks(sched)
    assert runner.step().scheduler_output.finished_req_ids == {"r1", "r3"}


def test_abort_between_schedule_and_update_is_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_len=4))
    sched.add_request(make_request("b", prompt_len=4))
    so = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = sched.update_from_output(so, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [6]]))
    assert [o.req_id for o in out] == ["b"]
    assert sched.schedule().finished_req_ids == {"a"}


def test_prefix_hit_reported_and_only_the_rest_computed():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    tokens = prompt_tokens("doc", 21)
    sched.add_request(make_request("a", prompt_token_ids=tokens, max_tokens=1))
    outs = runner.run()
    assert outs["a"][0].num_cached_tokens == 0
    sched.add_request(make_request("b", prompt_token_ids=tokens + [42], max_tokens=2))
    so = runner.step().scheduler_output
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20 and scheduled(so) == {"b": 2}
    outs = runner.run()
    assert outs["b"][-1].num_cached_tokens == 20 and sched.requests == {}
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21 + 22, 20)
    assert sched.reset_prefix_cache() is True
    assert sched.kv_cache_manager.block_pool.get_cached_block(
        sched.kv_cache_manager.block_pool.blocks[1].block_hash or 0) is None


def test_prompt_logprobs_emitted_per_chunk_without_tokens():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched, prompt_logprobs=True)
    sched.add_request(make_request("p", prompt_len=40, max_tokens=1, prompt_logprobs=1))
    outs = runner.run()["p"]
    assert [len(o.new_prompt_logprobs.token_ids) for o in outs] == [16, 16, 8]
    assert [o.new_token_ids for o in outs] == [[], [], [1000]]
    assert outs[-1].finished


def test_sampled_logprobs_passed_through_and_timestamps_set():
    sched = make_scheduler()
    req = make_request("a", prompt_len=4, max_tokens=1)
    sched.add_request(req)
    so = sched.schedule()
    assert req.scheduled_time is not None and req.first_token_time is None
    lp = LogprobsLists([[9]], [[-0.5]], [1])
    out = sched.update_from_output(so, ModelRunnerOutput(["a"], [[9]], logprobs={"a": lp}))
    assert out[0].new_logprobs is lp and out[0].finish_reason == "length"
    assert req.first_token_time is not None and req.finished_time is not None


def test_stats_snapshot():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt_len=5, max_tokens=3))
    runner.step()
    stats = sched.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_steps) == (2, 1, 1)
    assert stats.num_scheduled_tokens == 10 and stats.max_reqs_per_step == 2
    assert 0 < stats.kv_cache_usage < 1 and stats.num_active_loras == 0


# --------------------------------------------------------------------------------------
# The step message
# --------------------------------------------------------------------------------------
def test_step_message_is_frozen_once_scheduled_and_pickles():
    """Nothing can edit a ``SchedulerOutput`` after ``schedule()``: its fields, the nested messages'
    fields, its sequences (tuples, frozensets) and its mappings (read-only views) all refuse; pickled
    (a tensor-parallel broadcast) it comes back equal and still read-only."""
    sched = make_scheduler(max_loras=1)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", prompt_len=6, max_tokens=4, lora_request=lora("A")))
    sched.add_request(make_request("b", prompt_len=6, max_tokens=4))
    runner.step()
    sched.add_request(make_request("c", prompt_len=6, max_tokens=4))
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    new, cached = so.scheduled_new_reqs[0], so.scheduled_cached_reqs
    assert new.req_id == "c" and cached.req_ids == ("a",) and so.finished_req_ids == {"b"}
    for message in (so, new, cached, runner.history[0].lora_loads[0]):
        for f in dataclasses.fields(message):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(message, f.name, getattr(message, f.name))
    with pytest.raises(TypeError):
        so.num_scheduled_tokens["a"] = 99
    with pytest.raises(TypeError):
        so.scheduled_encoder_inputs["a"] = (0,)
    assert isinstance(so.finished_req_ids, frozenset) and isinstance(new.eos_token_ids, frozenset)
    for seq in (so.scheduled_new_reqs, so.lora_loads, so.free_encoder_identifiers, new.all_token_ids,
                new.block_ids, new.mm_features, cached.new_block_ids[0], cached.lora_slots):
        assert isinstance(seq, tuple)
    back = pickle.loads(pickle.dumps(so))
    assert back == so and dict(back.num_scheduled_tokens) == {"a": 1, "c": 6}
    with pytest.raises(TypeError):
        back.num_scheduled_tokens["a"] = 99
