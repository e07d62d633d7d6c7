"""CUDA graphs for decode-only steps, one per batch-size bucket (vLLM's full decode graphs).

A decode-only step of ``R`` requests runs the graph of the smallest bucket ``B >= R``; rows
``R..B`` are padding (one token, null-block context, KV slot -1, logits ignored). Each graph
reads the runner's persistent step buffers (``StepBuffers``: input ids, positions, slot mapping,
query start locations, sequence lengths, block tables), so replaying needs no copies of its
own: the runner writes the step into those buffers, then replays. Attention is captured with
``max_query_len=1`` and ``max_seq_len=max_model_len``: the Triton kernel's grid depends only on
the batch size, and its split-KV segments are cut on the device from the real lengths, so one
graph serves every context length. Mixed and prefill steps run eagerly.

With LoRA, the shrink/expand kernels are captured with a fixed grid over every adapter slot and
read the manager's static meta tensors (``lora.batch.LoRAMetaBuffers``), which ``set_batch``
refills before each replay: one graph per bucket serves any mix of adapters and base rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionMetadata, forward_context
from engine.input_batch import StepBuffers

logger = logging.getLogger("chorus.cuda_graphs")

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""Graph batch sizes (requests), capped at ``max_num_seqs`` (which is always added)."""


def graph_batch_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """The buckets to capture, ascending."""
    cap = min(max_num_seqs, max_num_tokens)
    return sorted({b for b in BATCH_SIZE_BUCKETS if b < cap} | {cap})


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    """[batch_size, vocab] float32: the graph's output buffer, rewritten by every replay."""


class DecodeGraphs:
    """Captures and replays the decode graphs of one model over one set of step buffers.

    Args:
        model: has ``forward(input_ids, positions)`` and ``compute_logits(hidden)``.
        buffers: the runner's step buffers (the graphs' static inputs).
        max_model_len: the attention bound the kernels are captured with.
        batch_sizes: buckets to capture.
        lora_manager: the engine's ``LoRAManager`` when LoRA is on (its meta buffers are then
            static graph inputs too), else None.
    """

    def __init__(self, model: torch.nn.Module, buffers: StepBuffers, max_model_len: int,
                 batch_sizes: list[int], lora_manager=None) -> None:
        self.model = model
        self.lora_manager = lora_manager
        """``LoRAManager`` or None; captured graphs then include the fixed-grid LoRA kernels."""
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[int, _DecodeGraph] = {}
        self.num_replays = 0
        """Replays so far (tests check that decode steps took the graph path)."""

    def batch_size_for(self, num_reqs: int) -> Optional[int]:
        """Smallest captured bucket holding ``num_reqs`` requests (None: run eagerly)."""
        for b in self.batch_sizes:
            if b >= num_reqs:
                return b if b in self.graphs else None
        return None

    def _dummy_metadata(self, batch_size: int) -> AttentionMetadata:
        """Fill the buffers with ``batch_size`` padding requests and describe them."""
        buf = self.buffers
        buf.input_ids[:batch_size].zero_()
        buf.positions[:batch_size].zero_()
        buf.slot_mapping[:batch_size].fill_(-1)
        buf.query_start_loc[:batch_size + 1].copy_(
            torch.arange(batch_size + 1, dtype=torch.int32, device=buf.device))
        buf.seq_lens[:batch_size].fill_(1)
        buf.block_tables[:batch_size].zero_()
        if self.lora_manager is not None:
            self.lora_manager.set_batch(np.full(batch_size, -1, dtype=np.int32), fixed_grid=True)
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:batch_size], query_start_loc=buf.query_start_loc[:batch_size + 1],
            seq_lens=buf.seq_lens[:batch_size], block_tables=buf.block_tables[:batch_size],
            max_query_len=1, max_seq_len=self.max_model_len, num_decode_reqs=batch_size)

    def _forward(self, batch_size: int, meta: AttentionMetadata) -> torch.Tensor:
        with forward_context(meta):
            hidden = self.model(self.buffers.input_ids[:batch_size], self.buffers.positions[:batch_size])
        return self.model.compute_logits(hidden)                    # [batch_size, vocab] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        t0 = time.perf_counter()
        pool = None
        for b in sorted(self.batch_sizes, reverse=True):
            meta = self._dummy_metadata(b)
            self._forward(b, meta)          # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b, meta)
            pool = graph.pool()
            self.graphs[b] = _DecodeGraph(graph, logits)
        torch.cuda.synchronize()
        logger.info("Captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                    self.batch_sizes, time.perf_counter() - t0)

    def replay(self, batch_size: int) -> torch.Tensor:
        """Run the bucket's graph over what the buffers hold now; returns its logits buffer."""
        g = self.graphs[batch_size]
        g.graph.replay()
        self.num_replays += 1
        return g.logits
