"""``BatchGraphs``: an encoder forward whose items all have one shape, replayed from CUDA graphs captured at a
few batch sizes (Whisper's encoder: a 30 s window is always [num_mel_bins, 3000] log-mel frames -> [1500,
d_model], so its forward has one shape per batch size).

A call of ``n`` items runs in chunks of at most the largest captured size; each chunk is copied into the
first rows of one static input buffer and replays the graph of the smallest captured size that holds it.
The rows past the chunk are padding: they hold what an earlier call left there (zeros at first), and no
real row reads them, since every op of the forward works within one item (convolutions over its frames,
attention over its positions, row-wise projections and norms). The real rows of the static output are
copied out into one result tensor, so a later replay never overwrites what a caller holds.

Graphs are captured once (``capture``), largest first, into one shared memory pool; the warm-up forward
before each capture lets cuBLAS and the attention backend pick their kernels. ``use_graphs=False``
replaces each replay by the eager forward on the same static rows: the chunking, padding and slicing
run as on the GPU (the CPU tests use this).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Optional
from unittest import mock

import torch

logger = logging.getLogger("chorus.encoders")

ENCODER_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
"""Items per captured encoder graph, capped at the items one step may encode (which is always added)."""


def encoder_graph_sizes(max_items: int) -> list[int]:
    """The batch sizes to capture for calls of up to ``max_items`` items, ascending (empty for 0)."""
    cap = min(max_items, max(ENCODER_GRAPH_BATCH_SIZES))
    if cap < 1:
        return []
    return sorted({size for size in ENCODER_GRAPH_BATCH_SIZES if size < cap} | {cap})


def plan_chunks(num_items: int, sizes: list[int]) -> list[tuple[int, int, int]]:
    """(first item, items, captured batch size replayed) per chunk of a call of ``num_items`` items: chunks of
    the largest size, then one of the remainder in the smallest size that holds it."""
    largest = max(sizes)
    chunks = []
    for first in range(0, num_items, largest):
        count = min(largest, num_items - first)
        chunks.append((first, count, min(size for size in sizes if size >= count)))
    return chunks


class BatchGraphs:
    """Args:
        forward: the eager forward, [B, *item_shape] -> [B, *out_item_shape]; no op may mix items.
        item_shape: one item's input shape (Whisper: (num_mel_bins, 3000)).
        dtype: the static input's dtype (the forward's parameters'); callers' inputs are cast on the copy.
        device: where the forward runs.
        sizes: the batch sizes to capture (``encoder_graph_sizes``).
        use_graphs: capture CUDA graphs (CUDA); False: each replay runs ``forward`` eagerly on the same
            static rows (CPU tests of the chunking).
    """

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], item_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, sizes: list[int], use_graphs: bool = True) -> None:
        if not sizes:
            raise ValueError("BatchGraphs needs at least one batch size to capture.")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.device = device
        self.use_graphs = use_graphs
        self.static_input = torch.zeros(max(sizes), *item_shape, dtype=dtype, device=device)
        """[max(sizes), *item_shape]: every graph reads its first rows."""
        self.graphs: dict[int, tuple[Optional[torch.cuda.CUDAGraph], torch.Tensor]] = {}
        """Batch size -> (its graph, its static output [size, *out_item_shape])."""
        self.num_replays = 0
        """Chunks replayed since capture (a counter for tests and benchmarks)."""

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size's graph, largest first, into one memory pool (eager mode: nothing to do)."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        pool = None
        gc.collect()
        # NOTE: torch.cuda.graph runs gc.collect() and empty_cache() before every capture; once is enough.
        with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
            for size in reversed(self.sizes):
                rows = self.static_input[:size]
                self.forward(rows)                  # warm-up: cuBLAS and the attention backend pick kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(rows)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info("Captured %d encoder CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                    self.sizes, time.perf_counter() - t0)

    def _replay(self, size: int) -> torch.Tensor:
        """The forward of the first ``size`` static rows -> its output [size, *out_item_shape]."""
        self.num_replays += 1
        if not self.use_graphs:
            return self.forward(self.static_input[:size])
        graph, out = self.graphs[size]
        graph.replay()
        return out

    def __call__(self, items: torch.Tensor) -> torch.Tensor:
        """items [n, *item_shape] (any float dtype) -> [n, *out_item_shape], a tensor of its own."""
        result: Optional[torch.Tensor] = None
        for first, count, size in plan_chunks(items.shape[0], self.sizes):
            self.static_input[:count].copy_(items[first:first + count])
            out = self._replay(size)                                     # [size, *out_item_shape]
            if result is None:
                result = torch.empty(items.shape[0], *out.shape[1:], dtype=out.dtype, device=out.device)
            result[first:first + count].copy_(out[:count])
        if result is None:
            raise ValueError("BatchGraphs: a call needs at least one item.")
        return result
