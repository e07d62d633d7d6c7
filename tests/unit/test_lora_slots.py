"""LoRA slots: the slot manager, and the scheduler's use of it (max_loras per step, loads,
no starvation, remove_lora). ``FakeRunner`` loads adapters only when told and checks that every
scheduled request's slot holds its adapter."""

from __future__ import annotations

import random

import pytest

from engine.request import RequestStatus
from lora import NO_LORA
from lora.slot_manager import LoRASlotManager, SlotGrant
from tests.unit.fakes import FakeRunner, assert_no_leaks, lora, make_request, make_scheduler

A, B, C = lora("A"), lora("B"), lora("C")


# --------------------------------------------------------------------------------------
# LoRASlotManager
# --------------------------------------------------------------------------------------
def test_acquire_reuses_resident_then_fills_free_then_gives_up():
    m = LoRASlotManager(2)
    assert m.acquire(A) == SlotGrant(0, True)
    assert m.acquire(A) == SlotGrant(0, False)
    assert m.acquire(B) == SlotGrant(1, True)
    assert not m.can_acquire(C) and m.acquire(C) is None
    assert m.num_running(0) == 2 and m.resident_loras() == {"A": 0, "B": 1}


def test_idle_slot_evicted_lru_and_resident_adapter_not_reloaded():
    m = LoRASlotManager(2)
    m.acquire(A)
    m.acquire(B)
    m.release(A)  # A idle: kept resident
    assert m.slot_of("A") == 0 and m.acquire(A) == SlotGrant(0, False)
    m.release(B)  # B idle, A busy: B's slot is the only candidate
    m.release(A)  # now both idle; B was released first -> least recently used
    assert m.acquire(C) == SlotGrant(1, True)
    assert m.slot_of("B") is None and m.slot_of("A") == 0
    assert m.acquire(B) == SlotGrant(0, True)  # A was idle: evicted
    assert m.lora_in_slot(0) == B


def test_release_of_unheld_adapter_is_a_bug():
    m = LoRASlotManager(1)
    with pytest.raises(AssertionError):
        m.release(A)


def test_remove_idle_busy_and_unknown():
    m = LoRASlotManager(2)
    assert m.remove("A") is False
    m.acquire(A)
    m.acquire(B)
    m.release(B)
    assert m.remove("B") is True and m.slot_of("B") is None  # idle: freed at once
    assert m.remove("A") is True and m.slot_of("A") == 0  # busy: freed on last release
    m.release(A)
    assert m.slot_of("A") is None and m.num_resident == 0
    # acquiring an adapter pending removal cancels the removal
    m.acquire(A)
    m.remove("A")
    m.acquire(A)
    m.release(A)
    m.release(A)
    assert m.slot_of("A") == 0


def test_pick_drain_slot_fewest_running_then_lru():
    m = LoRASlotManager(3)
    assert m.pick_drain_slot() is None
    for lr, n in ((A, 2), (B, 1), (C, 1)):
        for _ in range(n):
            m.acquire(lr)
    assert m.pick_drain_slot() == 1  # B and C tie on 1 running; B used longer ago
    assert m.pick_drain_slot({0: 1, 1: 5, 2: 3}) == 0  # cost first (e.g. steps until idle)


# --------------------------------------------------------------------------------------
# Scheduler with adapters
# --------------------------------------------------------------------------------------
def test_adapters_not_in_host_memory_wait_and_every_load_is_of_a_ready_one():
    """The scheduler asks ``lora_ready`` (given at construction) before it hands out a slot: a request
    whose adapter is not in host memory waits (its read is under way) while the others run, and gets
    its slot, with the step's load, once the adapter is ready."""
    ready = {"A"}
    asked = []

    def lora_ready(lora_request) -> bool:
        asked.append(lora_request.lora_name)
        return lora_request.lora_name in ready

    sched = make_scheduler(max_loras=2, lora_ready=lora_ready)
    runner = FakeRunner(sched)
    for rid, adapter in (("b1", B), ("a1", A), ("base", None)):
        sched.add_request(make_request(rid, lora_request=adapter, max_tokens=3))
    so = runner.step().scheduler_output
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a1", "base"] and asked == ["B", "A"]
    assert [ld.lora_request.lora_name for ld in so.lora_loads] == ["A"]
    assert sched.requests["b1"].status == RequestStatus.WAITING and sched.lora_slots.slot_of("B") is None
    ready.add("B")
    so = runner.step().scheduler_output
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b1"]
    assert [(ld.lora_slot, ld.lora_request.lora_name) for ld in so.lora_loads] == [(1, "B")]
    runner.run()
    assert_no_leaks(sched)


def test_step_rank_rows_count_each_steps_distinct_adapters_once():
    """``num_lora_step_rank_rows`` adds, per step, the ranks of the adapters that step runs (each once,
    however many of its requests run): what the step's LoRA kernels must read at least."""
    ranks = {"A": 8, "B": 16}
    sched = make_scheduler(max_loras=2, lora_rank=lambda lr: ranks[lr.lora_name])
    runner = FakeRunner(sched)
    for rid, adapter in (("a1", A), ("a2", A), ("b1", B), ("base", None)):
        sched.add_request(make_request(rid, lora_request=adapter, max_tokens=2))
    runner.step()                                      # prefills: A and B
    assert sched.get_stats().num_lora_step_rank_rows == 8 + 16
    sched.finish_requests("b1", RequestStatus.FINISHED_ABORTED)
    runner.step()                                      # decodes: A only
    assert sched.get_stats().num_lora_step_rank_rows == 8 + 16 + 8
    runner.run()
    assert_no_leaks(sched)


def test_loads_only_when_not_resident_and_slots_in_step_message():
    sched = make_scheduler(max_loras=2)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a1", lora_request=A))
    sched.add_request(make_request("a2", lora_request=A))
    sched.add_request(make_request("base"))
    so = runner.step().scheduler_output
    assert [(ld.lora_slot, ld.lora_request.lora_name) for ld in so.lora_loads] == [(0, "A")]
    assert [r.lora_slot for r in so.scheduled_new_reqs] == [0, 0, NO_LORA]
    so = runner.step().scheduler_output
    assert so.lora_loads == () and so.scheduled_cached_reqs.lora_slots == (0, 0, NO_LORA)
    runner.run()
    # a later request of the resident (idle) adapter reuses the slot without a load
    sched.add_request(make_request("a3", lora_request=A))
    assert runner.step().scheduler_output.lora_loads == ()
    runner.run()
    assert runner.num_loads == 1 and sched.get_stats().num_active_loras == 1
    assert_no_leaks(sched)


def test_blocked_lora_request_does_not_block_others_and_keeps_its_place():
    sched = make_scheduler(max_loras=1)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a0", lora_request=A, max_tokens=5))
    runner.step()
    for req in (make_request("b0", lora_request=B), make_request("base"), make_request("a1", lora_request=A)):
        sched.add_request(req)
    so = runner.step().scheduler_output
    # b0 cannot get the only slot and is skipped; base (no slot) and a1 (resident) go ahead.
    assert [r.req_id for r in so.scheduled_new_reqs] == ["base", "a1"]
    assert [r.request_id for r in sched.waiting] == ["b0"]
    # b0 now holds the reservation: A's slot drains, later A requests wait behind b0.
    assert (sched._lora_reservation.req_id, sched._lora_reservation.drain_slot) == ("b0", 0)
    sched.add_request(make_request("a2", lora_request=A))
    sched.add_request(make_request("b1", lora_request=B))
    while "a0" in sched.requests or "a1" in sched.requests:
        assert not runner.step().scheduler_output.scheduled_new_reqs
        assert [r.request_id for r in sched.waiting] == ["b0", "a2", "b1"]
    so = runner.step().scheduler_output
    # b0 takes the idle slot and brings b1 (same adapter) along; a2 is next in line.
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b0", "b1"]
    assert [(ld.lora_slot, ld.lora_request.lora_name) for ld in so.lora_loads] == [(0, "B")]
    assert sched._lora_reservation.req_id == "a2"
    runner.run()
    assert_no_leaks(sched)


def test_reservation_waits_for_the_grace_steps():
    sched = make_scheduler(max_loras=1)
    sched.lora_reserve_after_steps = 3
    runner = FakeRunner(sched)
    sched.add_request(make_request("a0", lora_request=A, max_tokens=30))
    runner.step()
    sched.add_request(make_request("b0", lora_request=B))
    admitted = []
    for i in range(6):
        sched.add_request(make_request(f"a{i + 1}", lora_request=A, max_tokens=30))
        admitted += [r.req_id for r in runner.step().scheduler_output.scheduled_new_reqs]
    # blocked at steps 0..3 of its wait; reserves after the 4th; A admissions stop then
    assert admitted == ["a1", "a2", "a3", "a4"]
    assert sched._lora_reservation.req_id == "b0"
    runner.run()
    assert_no_leaks(sched)


def plain_lru(sched):
    """Ablation: admit whenever a slot is resident, empty or idle (no reservations)."""
    sched._lora_admissible = lambda req: sched.lora_slots.can_acquire(req.lora_request)


def test_reserve_and_drain_prevents_starvation_that_plain_lru_allows():
    def run(fair: bool) -> int | None:
        sched = make_scheduler(max_loras=2, max_num_seqs=64, max_num_batched_tokens=256, num_blocks=512)
        if not fair:
            plain_lru(sched)
        runner = FakeRunner(sched)
        for step in range(80):
            # a continuous stream keeps both slots busy forever
            sched.add_request(make_request(f"A{step}", prompt_len=4, max_tokens=6, lora_request=A))
            sched.add_request(make_request(f"B{step}", prompt_len=4, max_tokens=6, lora_request=B))
            if step == 3:
                sched.add_request(make_request("C", prompt_len=4, max_tokens=6, lora_request=C))
            for out in runner.step().outputs:
                if out.req_id == "C" and out.finished:
                    return step
        return None

    assert run(fair=False) is None  # C never gets a slot
    finished_at = run(fair=True)
    assert finished_at is not None and finished_at - 3 <= 6 + 6 + 2  # one drain + its own run


def run_8_adapters_2_slots(seed: int, fair: bool, num_steps: int = 300) -> dict[str, int]:
    """Two hot adapters get a request every step (their slots never idle on their own), six
    cold adapters and the base model get random ones. Returns each request's wait (steps
    from arrival to finish)."""
    rng = random.Random(seed)
    adapters = [lora(f"ad{i}") for i in range(8)]
    sched = make_scheduler(max_loras=2, max_num_seqs=48, max_num_batched_tokens=128, num_blocks=400)
    if not fair:
        plain_lru(sched)
    runner = FakeRunner(sched)
    arrivals: dict[str, int] = {}
    waits: dict[str, int] = {}
    counter = 0
    while runner.step_count < num_steps or sched.has_unfinished_requests():
        step = runner.step_count
        if step < num_steps:
            new = [adapters[0], adapters[1]]
            if rng.random() < 0.3:
                new.append(rng.choice(adapters[2:]))
            if rng.random() < 0.5:
                new.append(None)
            for adapter in new:
                sched.add_request(make_request(f"r{counter}", prompt_len=rng.randrange(1, 12),
                                               max_tokens=rng.randrange(3, 9), lora_request=adapter))
                arrivals[f"r{counter}"] = step
                counter += 1
        for out in runner.step().outputs:
            if out.finished:
                waits[out.req_id] = step - arrivals[out.req_id]
        assert runner.step_count < 5 * num_steps
    assert set(waits) == set(arrivals)
    assert_no_leaks(sched)
    return waits


@pytest.mark.parametrize("seed", [0, 1])
def test_no_starvation_8_adapters_2_slots_continuous_stream(seed):
    # Bound from the rule: (distinct adapters ahead + 1) x (one drain <= max_tokens + 1),
    # i.e. 8 x 9 steps here; observed ~35.
    waits = run_8_adapters_2_slots(seed, fair=True)
    assert max(waits.values()) <= 8 * 9, sorted(waits.values())[-5:]
    # The same stream under plain LRU: the cold adapters wait for the whole stream.
    assert max(run_8_adapters_2_slots(seed, fair=False).values()) > 250


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_many_adapters_respects_max_loras(policy):
    rng = random.Random(7)
    adapters = [lora(f"m{i}") for i in range(12)]
    sched = make_scheduler(max_loras=3, max_num_seqs=8, max_num_batched_tokens=32, num_blocks=40,
                           policy=policy)
    runner = FakeRunner(sched)
    for i in range(150):
        sched.add_request(make_request(
            f"x{i}", prompt_len=rng.randrange(1, 30), max_tokens=rng.randrange(1, 12),
            lora_request=rng.choice(adapters + [None]), priority=rng.randrange(3)))
    runner.run()  # FakeRunner asserts <= 3 adapters per step and slot contents every step
    assert sched.get_stats().num_preemptions > 0
    assert_no_leaks(sched)


def test_preempted_lora_request_releases_and_reacquires_its_slot():
    sched = make_scheduler(max_loras=1, num_blocks=4)  # 3 usable blocks
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", prompt_len=4, max_tokens=5, lora_request=A))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=5, lora_request=A))
    runner.step()
    assert sched.lora_slots.num_running(0) == 2
    runner.step()  # a takes the last free block
    so = runner.step().scheduler_output  # b needs one more: it is last, preempted
    assert so.preempted_req_ids == {"b"} and sched.lora_slots.num_running(0) == 1
    runner.run()
    assert runner.num_loads == 1  # resumed without reloading
    assert_no_leaks(sched)


def test_remove_lora_waits_for_its_requests():
    sched = make_scheduler(max_loras=2)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", lora_request=A, max_tokens=3))
    sched.add_request(make_request("b", lora_request=B, max_tokens=3))
    assert sched.remove_lora("A") is False  # waiting on it
    runner.step()
    assert sched.remove_lora("A") is False  # running on it
    assert sched.remove_lora("unknown") is True
    runner.run()
    assert sched.lora_slots.slot_of("A") is not None
    assert sched.remove_lora("A") is True
    assert sched.lora_slots.slot_of("A") is None and sched.get_stats().num_active_loras == 1
    # the freed slot is taken by the next adapter without evicting B
    sched.add_request(make_request("c", lora_request=C))
    so = runner.step().scheduler_output
    assert [(ld.lora_slot, ld.lora_request.lora_name) for ld in so.lora_loads] == [(0, "C")]
    assert sched.lora_slots.slot_of("B") == 1
    runner.run()
    assert_no_leaks(sched)


def test_aborted_reservation_holder_releases_the_drain():
    sched = make_scheduler(max_loras=1)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a0", lora_request=A, max_tokens=20))
    runner.step()
    sched.add_request(make_request("b0", lora_request=B))
    runner.step()
    assert sched._lora_reservation is not None and sched._lora_reservation.req_id == "b0"
    sched.finish_requests(["b0"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("a1", lora_request=A))
    so = runner.step().scheduler_output
    assert sched._lora_reservation is None and [r.req_id for r in so.scheduled_new_reqs] == ["a1"]
    runner.run()
    assert_no_leaks(sched)
