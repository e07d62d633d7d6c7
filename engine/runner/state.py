"""``RequestStates``: what the runner remembers about its requests between steps, kept by the scheduler's
diffs (``SchedulerOutput``), with the persistent block table rows and the sampled ids still in flight."""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np
import torch

from engine.input_batch import NO_ROW, BlockTableRows, CachedRequestState
from engine.models.interfaces import LogitsRules, SupportsMRoPE
from engine.outputs import SchedulerOutput
from engine.runner.pending import PendingOutput


class RequestStates:
    """The runner's per-request state.

    Args:
        max_num_seqs: requests at once (the block table's rows).
        max_blocks_per_req: blocks of a ``max_model_len`` request.
        max_cross_blocks: cross-attention blocks of a request (encoder-decoder models; 0: none).
        num_kv_groups: KV cache groups (``engine.kv_cache_groups``); groups 1.. have their own block tables.
        device: where seeded requests' generators draw.
        logits_rules: the model's logits rules (each new request records whether they read its outputs).
        mrope_model: the model, when it rotates prompts with media by M-RoPE positions (else None).
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_req: int, max_cross_blocks: int,
                 device: torch.device, logits_rules: Optional[LogitsRules],
                 mrope_model: Optional[SupportsMRoPE], num_kv_groups: int = 1) -> None:
        self.device = device
        self.logits_rules = logits_rules
        self.mrope_model = mrope_model
        self.requests: dict[str, CachedRequestState] = {}
        """req_id -> its state (kept while preempted)."""
        self.block_table = BlockTableRows(max_num_seqs, max_blocks_per_req)
        """One row of block ids per active request (of KV cache group 0)."""
        self.group_tables = [BlockTableRows(max_num_seqs, max_blocks_per_req) for _ in range(num_kv_groups - 1)]
        """KV cache groups 1..'s block tables, each request in its ``block_table`` row."""
        self.cross_block_rows: Optional[np.ndarray] = (
            np.zeros((max_num_seqs, max_cross_blocks), dtype=np.int32) if max_cross_blocks else None)
        """[max_num_seqs, max_cross_blocks] int32: each block table row's cross blocks (one encoder input per
        request); None for decoder-only models."""
        self._in_flight: deque[tuple[PendingOutput, list[CachedRequestState]]] = deque()
        """Steps whose sampled ids are not in their requests' ``token_ids`` yet, oldest first, with the states
        that sampled (in the order of the step's sampled ids)."""

    def apply(self, so: SchedulerOutput) -> None:
        """The step's diff: finished and preempted requests give up their rows, new and resumed ones take one,
        running ones extend theirs."""
        table = self.block_table
        for rid in so.finished_req_ids:
            s = self.requests.pop(rid, None)
            if s is not None:
                table.remove(s.row)
                s.row = NO_ROW
        for rid in so.preempted_req_ids:
            s = self.requests.get(rid)
            if s is not None:
                s.active = False
                table.remove(s.row)
                s.row = NO_ROW
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            if old is not None:
                table.remove(old.row)
                old.row = NO_ROW
            generator = old.generator if old is not None else self._make_generator(new.sampling_params.seed)
            state = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.all_token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                eos_token_ids=set(new.eos_token_ids),
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=generator, lora_slot=new.lora_slot, row=table.add(new.block_ids),
                mm_features=new.mm_features, cross_block_ids=list(new.cross_block_ids),
                num_cross_tokens=sum(f.num_cross_embeds for f in new.mm_features))
            for t, ids in zip(self.group_tables, new.group_block_ids):
                t.set_row(state.row, ids)
            if state.cross_block_ids:
                self.cross_block_rows[state.row, :len(state.cross_block_ids)] = state.cross_block_ids
            if self.logits_rules is not None:
                prompt = state.token_ids[:state.num_prompt_tokens]
                state.rules_need_history = self.logits_rules.needs_history(prompt)
            if self.mrope_model is not None and new.mm_features:
                if old is not None and old.mrope_positions is not None:
                    state.mrope_positions, state.mrope_delta = old.mrope_positions, old.mrope_delta
                else:
                    state.mrope_positions, state.mrope_delta = self.mrope_model.mrope_positions(
                        new.num_prompt_tokens, new.mm_features)
            self.requests[new.req_id] = state
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            s = self.requests[rid]
            s.block_ids.extend(cached.new_block_ids[i])
            table.append(s.row, cached.new_block_ids[i])
            if cached.new_group_block_ids:
                for t, ids in zip(self.group_tables, cached.new_group_block_ids[i]):
                    t.append(s.row, ids)
            s.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.lora_slots:
                s.lora_slot = cached.lora_slots[i]
            s.active = True

    def _make_generator(self, seed: Optional[int]) -> Optional[torch.Generator]:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    # ------------------------------------------------------------------ sampled ids in flight
    def track(self, pending: PendingOutput, sampled_states: list[CachedRequestState]) -> None:
        """A launched step: its ids join ``sampled_states``' token ids in ``absorb_sampled``."""
        self._in_flight.append((pending, sampled_states))

    def absorb_sampled(self, keep_last: bool = False) -> None:
        """Append the sampled ids of the steps in flight to their requests' token ids, oldest first (waiting
        for them). ``keep_last``: the newest step stays in flight unless its ids were read already."""
        in_flight = self._in_flight
        while in_flight and (not keep_last or len(in_flight) > 1 or in_flight[0][0].resolved):
            pending, states = in_flight.popleft()
            for state, token_id in zip(states, pending.sampled_token_ids()):
                state.token_ids.append(token_id)
