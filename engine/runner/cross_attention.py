"""``CrossAttentionInputs``: an encoder-decoder model's cross-attention K/V, written once per request before
its first token into its cross blocks, and the step's metadata over them (``CrossAttentionBuffers``)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.input_batch import CachedRequestState
from engine.models.interfaces import SupportsEncoderDecoder
from engine.runner.cross_buffers import CrossAttentionBuffers
from engine.runner.row_calls import RowCalls


class CrossAttentionInputs:
    """Args:
        model: the model (``capabilities.encoder_decoder``).
        encoder_cache: media item content hash -> its encoder output [num_source_positions, hidden].
        cross_block_rows: [max_num_seqs, max_cross_blocks] int32, each block table row's cross blocks
            (``RequestStates.cross_block_rows``).
        block_size: tokens per KV block.
        device: where the step runs.
        row_calls: how the K/V projections run (forward context, adapter slots).
        lora_rows_per_call: with LoRA, the rows one K/V call may run (the LoRA step buffers' size);
            None: LoRA off (one call per step).
        max_num_reqs: requests in one step (``max_num_seqs``), the rows of the metadata buffers.
    """

    def __init__(self, model: SupportsEncoderDecoder, encoder_cache: dict[str, torch.Tensor],
                 cross_block_rows: np.ndarray, block_size: int, device: torch.device, row_calls: RowCalls,
                 lora_rows_per_call: Optional[int], max_num_reqs: int) -> None:
        self.model = model
        self.encoder_cache = encoder_cache
        self.cross_block_rows = cross_block_rows
        self.block_size = block_size
        self.device = device
        self.row_calls = row_calls
        self.lora_rows_per_call = lora_rows_per_call
        self.buffers = CrossAttentionBuffers(max_num_reqs, cross_block_rows.shape[1], model.num_source_positions,
                                             device)
        """The step's cross-attention metadata, in persistent buffers (eager steps and decode graphs)."""

    def write_kv(self, states: list[CachedRequestState]) -> None:
        """Project the encoder outputs of requests about to compute token 0 into their cross blocks (every
        decoder layer's cross-attention K/V), batched: one call, or with LoRA calls of at most
        ``lora_rows_per_call`` rows, each row under its request's adapter slot."""
        bs = self.block_size
        outputs: list[torch.Tensor] = []
        slots: list[np.ndarray] = []
        lora_slots: list[int] = []
        for s in states:
            if s.num_computed_tokens != 0 or not s.num_cross_tokens:
                continue
            feature = next(f for f in s.mm_features if f.placeholder is None)
            encoded = self.encoder_cache.get(feature.identifier)            # [num_cross_tokens, hidden]
            if encoded is None:
                raise RuntimeError(f"request {s.req_id}: its {feature.modality} {feature.identifier[:12]} is "
                                   "not in the encoder cache at its first step (the scheduler should have "
                                   "scheduled it)")
            position = np.arange(s.num_cross_tokens)
            blocks = np.asarray(s.cross_block_ids, dtype=np.int64)
            slots.append(blocks[position // bs] * bs + position % bs)
            outputs.append(encoded)
            lora_slots.append(s.lora_slot)
        with_lora = self.lora_rows_per_call is not None
        start = 0
        while start < len(outputs):
            stop, rows = start + 1, outputs[start].shape[0]
            while (stop < len(outputs) and
                   (not with_lora or rows + outputs[stop].shape[0] <= self.lora_rows_per_call)):
                rows += outputs[stop].shape[0]
                stop += 1
            slot_mapping = torch.from_numpy(np.concatenate(slots[start:stop])).to(self.device,
                                                                                  non_blocking=True)  # [rows]
            row_slots = None
            if with_lora:
                row_slots = np.repeat(np.asarray(lora_slots[start:stop], dtype=np.int32),
                                      [o.shape[0] for o in outputs[start:stop]])        # [rows]
            with self.row_calls.rows(row_slots):
                self.model.write_cross_kv(torch.cat(outputs[start:stop]), slot_mapping)
            start = stop

    def metadata(self, states: list[CachedRequestState], counts: list[int],
                 num_reqs_padded: Optional[int] = None) -> AttentionMetadata:
        """The step's requests over their cross blocks (every position visible to every query token), in the
        persistent buffers a decode graph reads; ``num_reqs_padded``: that graph's batch size (None: eager)."""
        num_reqs = len(states)
        rows = np.fromiter((s.row for s in states), np.int64, num_reqs)                       # [R]
        lengths = np.fromiter((s.num_cross_tokens for s in states), np.int32, num_reqs)      # [R]
        return self.buffers.prepare(self.cross_block_rows[rows], lengths, np.asarray(counts, dtype=np.int64),
                                    num_reqs_padded)
