"""``MediaEncoder``: runs the model's media encoders for the items a step schedules, keeps their outputs in
the encoder cache (the scheduler's ``EncoderCacheManager`` decides what stays), and gathers the embeddings
of a step's placeholder tokens from it."""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from engine.input_batch import CachedRequestState
from engine.models.interfaces import SupportsMultiModal
from engine.request import MultiModalFeature
from engine.runner.row_calls import RowCalls
from lora import NO_LORA


class MediaEncoder:
    """Args:
        model: the model (``capabilities.multimodal``).
        cache: media item content hash -> its encoder output [num_embeds, hidden] (shared with the
            cross-attention writes of an encoder-decoder model).
        row_calls: how the encoder calls run (forward context, adapter slots).
        device: where the step runs.
        adapts_encoder: some adapter may update the encoder (its rows then carry adapter slots).
    """

    def __init__(self, model: SupportsMultiModal, cache: dict[str, torch.Tensor], row_calls: RowCalls,
                 device: torch.device, adapts_encoder: bool) -> None:
        self.model = model
        self.cache = cache
        self.row_calls = row_calls
        self.device = device
        self.adapts_encoder = adapts_encoder

    def free(self, identifiers: Iterable[str]) -> None:
        """Drop the items the scheduler's encoder cache evicted."""
        for identifier in identifiers:
            self.cache.pop(identifier, None)

    def encode(self, scheduled: dict[str, list[int]], requests: dict[str, CachedRequestState]) -> int:
        """Encode the step's scheduled media items (req_id -> indices into its ``mm_features``; one batched
        call per modality) into the cache; an item keyed under an adapter
        (``MultiModalFeature.encoder_lora_name``) runs with its request's slot. Returns the items encoded."""
        by_modality: dict[str, dict[str, tuple[MultiModalFeature, int]]] = {}
        for req_id, input_ids in scheduled.items():
            state = requests[req_id]
            for i in input_ids:
                f = state.mm_features[i]
                # NOTE: one identifier, one adapter: every request naming it runs the same slot.
                lora_slot = state.lora_slot if f.encoder_lora_name is not None else NO_LORA
                by_modality.setdefault(f.modality, {})[f.identifier] = (f, lora_slot)
        num_encoded = 0
        for modality, items in by_modality.items():
            features = [f for f, _ in items.values()]
            row_slots, item_rows = None, None
            if self.adapts_encoder:
                item_rows = np.array([f.num_embeds for f in features], dtype=np.int64)      # [num_items]
                row_slots = np.repeat(np.fromiter((s for _, s in items.values()), np.int32, len(items)),
                                      item_rows)                                          # [num_rows]
            with self.row_calls.rows(row_slots, item_rows):
                outputs = self.model.embed_multimodal(modality, [f.data for f in features])
            for f, out in zip(features, outputs):
                if out.shape[0] != f.num_embeds:
                    raise RuntimeError(f"the encoder gave {out.shape[0]} embeddings for a {modality} of "
                                       f"{f.num_embeds}")
                self.cache[f.identifier] = out
            num_encoded += len(features)
        return num_encoded

    def gather(self, states: list[CachedRequestState], counts: list[int]
               ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(token indices [M] in the step, embeddings [M, hidden]) of the step's placeholder tokens, from the
        cache; None when the step has none."""
        token_idx: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        step_start = 0
        for s, n in zip(states, counts):
            c = s.num_computed_tokens
            if c >= s.num_prompt_tokens:   # placeholders lie in the prompt
                step_start += n
                continue
            for f in s.mm_features:
                if f.placeholder is None:
                    continue   # a cross-attention input (``engine.runner.cross_attention``)
                lo = max(f.placeholder.offset, c)
                hi = min(f.placeholder.offset + f.placeholder.length, c + n)
                if lo < hi:
                    embeds = self.cache.get(f.identifier)
                    if embeds is None:
                        raise RuntimeError(f"request {s.req_id}: its {f.modality} {f.identifier[:12]} is not "
                                           "in the encoder cache (the scheduler should have scheduled it)")
                    rows.append(embeds[lo - f.placeholder.offset:hi - f.placeholder.offset])
                    token_idx.append(torch.arange(step_start + lo - c, step_start + hi - c))
            step_start += n
        if not rows:
            return None
        return torch.cat(token_idx).to(self.device, non_blocking=True), torch.cat(rows)
