"""Fake requests and a fake model runner for scheduler / KV cache / LoRA slot tests.

``FakeRunner`` mirrors what the real runner does with a ``SchedulerOutput`` (keeps one row per
request built from the diffs, loads adapters into slots) and checks the step message against
the scheduler's own state every step: budgets, block tables, ref counts, adapter slots.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Optional

from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine.outputs import EngineCoreOutput, LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.request import EngineRequest, MultiModalFeature, PlaceholderRange, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from lora import NO_LORA
from lora.request import LoRARequest

EOS = 2
_arrival = itertools.count(1)
_lora_ids: dict[str, int] = {}


def lora(name: str) -> LoRARequest:
    """A LoRARequest with a stable int id per name."""
    lora_id = _lora_ids.setdefault(name, len(_lora_ids) + 1)
    return LoRARequest(name, lora_id, f"/fake/{name}")


def prompt_tokens(seed: str, n: int) -> list[int]:
    """n deterministic token ids (never EOS) derived from ``seed``."""
    rng = random.Random(zlib.crc32(seed.encode()))
    return [rng.randrange(10, 30000) for _ in range(n)]


def make_request(req_id: str, prompt_len: int = 8, *, prompt_token_ids: Optional[list[int]] = None,
                 max_tokens: int = 4, min_tokens: int = 0, ignore_eos: bool = False,
                 stop_token_ids: Optional[list[int]] = None, eos_token_ids: Iterable[int] = (EOS,),
                 priority: int = 0, arrival_time: Optional[float] = None,
                 lora_request: Optional[LoRARequest] = None, cache_salt: Optional[str] = None,
                 mm_features: Optional[list[MultiModalFeature]] = None,
                 prompt_logprobs: Optional[int] = None) -> Request:
    """A scheduler-side Request; ``max_tokens`` is taken as already resolved."""
    tokens = list(prompt_token_ids) if prompt_token_ids is not None else prompt_tokens(req_id, prompt_len)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_token_ids, prompt_logprobs=prompt_logprobs)
    return Request(EngineRequest(
        request_id=req_id, prompt=None, prompt_token_ids=tokens, sampling_params=params,
        eos_token_ids=set(eos_token_ids),
        arrival_time=float(next(_arrival)) if arrival_time is None else arrival_time,
        priority=priority, lora_request=lora_request, cache_salt=cache_salt,
        mm_features=list(mm_features or []), max_tokens=max_tokens))


def mm_feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, PlaceholderRange(offset, length))


def make_scheduler(*, max_num_batched_tokens: int = 64, max_num_seqs: int = 16, policy: str = "fcfs",
                   long_prefill_token_threshold: int = 0, block_size: int = 4, num_blocks: int = 64,
                   enable_prefix_caching: bool = True, max_model_len: int = 256,
                   max_loras: Optional[int] = None,
                   lora_ready: Optional[Callable[[LoRARequest], bool]] = None,
                   lora_rank: Optional[Callable[[LoRARequest], int]] = None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        policy=policy, long_prefill_token_threshold=long_prefill_token_threshold),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len=max_model_len, num_kv_blocks=num_blocks,
        lora_config=LoRAConfig(max_loras=max_loras) if max_loras is not None else None,
        lora_ready=lora_ready, lora_rank=lora_rank)


def default_token(req_id: str, output_index: int) -> int:
    return 1000 + output_index


@dataclass
class _Row:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_slot: int
    group_block_ids: list[list[int]] = field(default_factory=list)
    """KV cache groups 1..'s blocks."""


@dataclass
class StepResult:
    scheduler_output: SchedulerOutput
    outputs: list[EngineCoreOutput]


@dataclass
class FakeRunner:
    """Applies step diffs like the real runner and samples ``token_fn(req_id, index)``.

    Samples one token for each request whose computed count reaches its token count. Set
    ``prompt_logprobs=True`` to return a dummy prompt-logprobs entry for every request that
    asked for them.
    """

    scheduler: Scheduler
    token_fn: Callable[[str, int], int] = default_token
    prompt_logprobs: bool = False
    rows: dict[str, _Row] = field(default_factory=dict)
    slot_table: dict[int, str] = field(default_factory=dict)
    """lora_slot -> adapter name, as loaded by the runner."""
    num_loads: int = 0
    step_count: int = 0
    history: list[SchedulerOutput] = field(default_factory=list)

    def step(self) -> StepResult:
        so = self.scheduler.schedule()
        self.history.append(so)
        out = self.execute(so)
        outputs = self.scheduler.update_from_output(so, out)
        self.step_count += 1
        return StepResult(so, outputs)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        sched = self.scheduler
        cfg = sched.scheduler_config
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        self._apply_diff(so)
        self._check_block_tables()
        for load in so.lora_loads:
            self.slot_table[load.lora_slot] = load.lora_request.lora_name
            self.num_loads += 1
        adapters_in_step = set()
        req_ids, sampled, prompt_lps = [], [], {}
        for req_id, n in so.num_scheduled_tokens.items():
            row = self.rows[req_id]
            request = sched.requests[req_id]
            if request.lora_request is None:
                assert row.lora_slot == NO_LORA
            else:
                assert self.slot_table.get(row.lora_slot) == request.lora_request.lora_name, (
                    f"{req_id} runs in slot {row.lora_slot} holding {self.slot_table.get(row.lora_slot)}")
                adapters_in_step.add(request.lora_request.lora_name)
            assert row.token_ids == request.all_token_ids
            row.num_computed_tokens += n
            assert row.num_computed_tokens == request.num_computed_tokens
            assert len(row.block_ids) * sched.block_size >= row.num_computed_tokens
            if self.prompt_logprobs and request.sampling_params.prompt_logprobs is not None:
                prompt_lps[req_id] = LogprobsLists([[0]] * n, [[-1.0]] * n, [1] * n)
            req_ids.append(req_id)
            if row.num_computed_tokens == len(row.token_ids):
                token = self.token_fn(req_id, request.num_output_tokens)
                row.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        if sched.lora_config is not None:
            assert len(adapters_in_step) <= sched.lora_config.max_loras
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=prompt_lps)

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(req_id, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.rows, f"{nr.req_id} sent as new twice"
            for ids in (nr.block_ids, *nr.group_block_ids):
                # Only before a sliding window (prefix hits there are not taken) does the null block stand.
                live = ids[next((i for i, b in enumerate(ids) if b != 0), len(ids)):]
                assert 0 not in live, "null block handed out"
            self.rows[nr.req_id] = _Row(list(nr.all_token_ids), list(nr.block_ids),
                                        nr.num_computed_tokens, nr.lora_slot, [list(g) for g in nr.group_block_ids])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            row = self.rows[req_id]
            assert row.num_computed_tokens == cached.num_computed_tokens[i]
            assert 0 not in cached.new_block_ids[i]
            assert not cached.new_group_block_ids or not any(0 in g for g in cached.new_group_block_ids[i])
            row.block_ids.extend(cached.new_block_ids[i])
            for ids, new in zip(row.group_block_ids, cached.new_group_block_ids[i] if cached.new_group_block_ids
                                else ()):
                ids.extend(new)
            row.lora_slot = cached.lora_slots[i]

    def _check_block_tables(self) -> None:
        """Runner rows == running requests; block tables and ref counts match the pool."""
        sched = self.scheduler
        kv = sched.kv_cache_manager
        assert set(self.rows) == {r.request_id for r in sched.running}
        ref = [0] * kv.block_pool.num_blocks
        for req_id, row in self.rows.items():
            assert len(row.group_block_ids) == kv.num_groups - 1
            for g, ids in enumerate([row.block_ids, *row.group_block_ids]):
                held = kv.get_block_ids(req_id, g)
                # A block returned out of a sliding window is the null block 0 in the manager's list; the
                # runner's table keeps the old id, never read again.
                assert len(ids) == len(held)
                assert all(h in (b, 0) for b, h in zip(ids, held)), (g, ids, held)
                for b in held:
                    ref[b] += 1
        for block in kv.block_pool.blocks[1:]:
            assert block.ref_cnt == ref[block.block_id], block
        assert kv.num_free_blocks == sum(1 for r in ref[1:] if r == 0)

    def run(self, max_steps: int = 10_000, on_step: Optional[Callable[[int], None]] = None,
            min_steps: int = 0) -> dict[str, list[EngineCoreOutput]]:
        """Step until nothing is left (and at least ``min_steps`` steps ran, calling ``on_step``
        before each, e.g. to add requests); returns each request's outputs."""
        by_req: dict[str, list[EngineCoreOutput]] = {}
        for _ in range(max_steps):
            if on_step is not None:
                on_step(self.step_count)
            if not self.scheduler.has_unfinished_requests() and self.step_count >= min_steps:
                return by_req
            for o in self.step().outputs:
                by_req.setdefault(o.req_id, []).append(o)
        raise AssertionError(f"not done after {max_steps} steps: {list(self.scheduler.requests)}")


def assert_no_leaks(sched: Scheduler) -> None:
    """Nothing held: every block free, every slot idle, no request left."""
    kv = sched.kv_cache_manager
    assert not sched.requests and not sched.running and len(sched.waiting) == 0
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not any(g.req_to_blocks for g in kv.groups)
    if sched.lora_slots is not None:
        assert all(sched.lora_slots.num_running(s) == 0 for s in range(sched.lora_slots.max_loras))
