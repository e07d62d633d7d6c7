"""Runner-side per-request state and the flat step inputs built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    token_ids: list[int]
    """Prompt + every output token sampled so far."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is in the cache before this step."""
    generator: Optional[torch.Generator]
    """Per-request generator for seeded sampling (kept across preemption)."""
    lora_slot: int = -1
    active: bool = True
    """False while preempted (state kept, row dropped)."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class StepInputs:
    """Flat tensors for one forward pass, plus where to read logits."""

    req_ids: list[str]
    """Scheduled requests in row order (decodes first)."""
    input_ids: torch.Tensor
    """[num_tokens] int64."""
    positions: torch.Tensor
    """[num_tokens] int64."""
    attn_metadata: AttentionMetadata
    sample_req_ids: list[str]
    """Requests that sample a token this step (their chunk reaches the end of known tokens)."""
    logits_indices: torch.Tensor
    """[num_sampled] int64: token index whose hidden state yields each sampled request's logits."""
    token_lora_slots: Optional[torch.Tensor] = None
    """[num_tokens] int32 adapter slot per token (-1: base model); None when LoRA is off."""
    prompt_logprob_ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """req_id -> (first token index in the batch, count, first prompt position) for prompt logprobs."""


def build_step_inputs(states: list[CachedRequestState], num_scheduled: list[int], block_size: int,
                      device: torch.device, with_lora: bool) -> StepInputs:
    """Lay scheduled tokens out flat. ``states``/``num_scheduled`` must put decodes (1 token) first."""
    num_reqs = len(states)
    qlens = np.asarray(num_scheduled, dtype=np.int64)
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    seq_lens = np.empty(num_reqs, dtype=np.int64)
    max_blocks = max(len(s.block_ids) for s in states)
    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    lora_slots = np.empty(num_tokens, dtype=np.int32) if with_lora else None
    sample_req_ids: list[str] = []
    logits_indices: list[int] = []
    prompt_ranges: dict[str, tuple[int, int, int]] = {}
    num_decodes = 0
    for i, (s, n) in enumerate(zip(states, num_scheduled)):
        start, end = int(qsl[i]), int(qsl[i + 1])
        c = s.num_computed_tokens
        input_ids[start:end] = s.token_ids[c:c + n]
        pos = np.arange(c, c + n, dtype=np.int64)
        positions[start:end] = pos
        bids = np.asarray(s.block_ids, dtype=np.int64)
        slot_mapping[start:end] = bids[pos // block_size] * block_size + pos % block_size
        seq_lens[i] = c + n
        block_tables[i, :len(s.block_ids)] = s.block_ids
        if lora_slots is not None:
            lora_slots[start:end] = s.lora_slot
        if n == 1 and i == num_decodes:
            num_decodes += 1
        if c + n >= len(s.token_ids):
            sample_req_ids.append(s.req_id)
            logits_indices.append(end - 1)
        if s.sampling_params.prompt_logprobs is not None and c < s.num_prompt_tokens:
            # Logits at position p score prompt token p + 1; the last prompt position scores
            # the first output token, which is not a prompt logprob.
            last = min(c + n, s.num_prompt_tokens - 1)
            if last > c:
                prompt_ranges[s.req_id] = (start, last - c, c + 1)

    def t(a, dtype=torch.int64):
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=t(slot_mapping),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t(block_tables, torch.int32),
        max_query_len=int(qlens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        num_decode_reqs=num_decodes,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return StepInputs(
        req_ids=[s.req_id for s in states], input_ids=t(input_ids), positions=t(positions),
        attn_metadata=meta, sample_req_ids=sample_req_ids,
        logits_indices=t(np.asarray(logits_indices, dtype=np.int64)),
        token_lora_slots=t(lora_slots, torch.int32) if lora_slots is not None else None,
        prompt_logprob_ranges=prompt_ranges)
