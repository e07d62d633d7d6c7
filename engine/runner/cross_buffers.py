"""``CrossAttentionBuffers``: a step's cross-attention metadata (each request over its cross blocks) in
persistent device buffers, filled from host mirrors used in turn, so eager steps and CUDA-graph replays read
the same tensors.

A decode graph of ``B`` rows is captured over views of these buffers (``capture_metadata``); a step of
``R <= B`` requests fills rows ``0..R`` with its requests and ``R..B`` with padding rows (one query token,
one position of block 0, never read by anything the step keeps), then replays. An eager step fills only its
own rows and reads the same views with its real bounds.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionMetadata


class _CrossHostMirror:
    """One set of host staging arrays (pinned on CUDA) and the event after their copies."""

    def __init__(self, max_num_reqs: int, max_cross_blocks: int, pin: bool) -> None:
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, pin_memory=pin)   # [R_max + 1]
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=pin)              # [R_max]
        self.block_tables = torch.zeros((max_num_reqs, max_cross_blocks), dtype=torch.int32,
                                        pin_memory=pin)                                    # [R_max, blocks]
        self.copied: Optional[torch.cuda.Event] = torch.cuda.Event() if pin else None
        """Recorded after this mirror's copies; waited on before the mirror is written again."""


class CrossAttentionBuffers:
    """Args:
        max_num_reqs: requests in one step (``max_num_seqs``; at least the largest decode graph).
        max_cross_blocks: cross blocks of one request (``ceil(num_source_positions / block_size)``).
        max_cross_len: cross-attention positions of one request at most (``num_source_positions``): the
            bound graphs are captured with.
        device: where the model runs; on CUDA the mirrors are pinned and the copies non-blocking.
    """

    def __init__(self, max_num_reqs: int, max_cross_blocks: int, max_cross_len: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_cross_len = max_cross_len
        self.device = device
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)   # [R_max + 1]
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)              # [R_max]
        self.block_tables = torch.zeros((max_num_reqs, max_cross_blocks), dtype=torch.int32,
                                        device=device)                                     # [R_max, blocks]
        pin = device.type == "cuda"
        self._mirrors = [_CrossHostMirror(max_num_reqs, max_cross_blocks, pin) for _ in range(2)]
        self._turn = 0

    def prepare(self, tables: np.ndarray, lengths: np.ndarray, counts: np.ndarray,
                num_reqs_padded: Optional[int] = None) -> AttentionMetadata:
        """Fill the buffers with one step's requests and return the metadata over them.

        Args:
            tables: [R, max_cross_blocks] int32, each request's cross blocks.
            lengths: [R] int32, each request's cross-attention positions (> 0).
            counts: [R] int64, each request's query tokens this step (> 0).
            num_reqs_padded: a decode graph's batch size ``B >= R`` (every count is 1): rows ``R..B`` become
                padding rows of one query token over one position of block 0; None: no padding.
        """
        num_reqs = len(counts)
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if not num_reqs <= padded <= self.max_num_reqs:
            raise RuntimeError(f"a step of {num_reqs} requests padded to {padded} does not fit the "
                               f"cross-attention buffers ({self.max_num_reqs} rows)")
        m = self._mirrors[self._turn]
        self._turn ^= 1
        if m.copied is not None:
            m.copied.synchronize()   # its previous copies are done (normally long ago)
        qsl, seq_lens, block_tables = m.query_start_loc.numpy(), m.seq_lens.numpy(), m.block_tables.numpy()
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:num_reqs + 1])
        qsl[num_reqs + 1:padded + 1] = qsl[num_reqs] + np.arange(1, padded - num_reqs + 1)
        seq_lens[:num_reqs] = lengths
        seq_lens[num_reqs:padded] = 1
        block_tables[:num_reqs] = tables
        block_tables[num_reqs:padded] = 0
        non_blocking = m.copied is not None
        self.query_start_loc[:padded + 1].copy_(m.query_start_loc[:padded + 1], non_blocking=non_blocking)
        self.seq_lens[:padded].copy_(m.seq_lens[:padded], non_blocking=non_blocking)
        self.block_tables[:padded].copy_(m.block_tables[:padded], non_blocking=non_blocking)
        if m.copied is not None:
            m.copied.record()
        return AttentionMetadata(
            slot_mapping=self.seq_lens[:0].long(),   # cross-attention writes nothing
            query_start_loc=self.query_start_loc[:padded + 1], seq_lens=self.seq_lens[:padded],
            block_tables=self.block_tables[:padded],
            max_query_len=int(counts.max()) if num_reqs else 0,
            max_seq_len=int(lengths.max()) if num_reqs else 0,
            num_decode_reqs=int(np.count_nonzero(counts == 1)) + padded - num_reqs,
            query_start_loc_cpu=qsl[:padded + 1].tolist(), seq_lens_cpu=seq_lens[:padded].tolist())

    def capture_metadata(self, num_reqs: int) -> AttentionMetadata:
        """Fill rows ``0..num_reqs`` with padding and return the metadata a decode graph of ``num_reqs`` rows is
        captured with: views of the buffers, one query per row, ``max_cross_len`` as the length bound."""
        meta = self.prepare(np.zeros((0, self.block_tables.shape[1]), dtype=np.int32),
                            np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), num_reqs)
        meta.max_query_len, meta.max_seq_len, meta.captured = 1, self.max_cross_len, True
        meta.query_start_loc_cpu = meta.seq_lens_cpu = None   # a replay's rows are not the capture's
        return meta
