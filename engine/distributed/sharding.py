"""The sharding math of tensor parallelism: which rows or columns of each weight a rank holds.

Pure functions over ints, shared by the sharded layers (``engine.layers.parallel``), the checkpoint
reader (each rank reads only its ranges) and the LoRA slots (S-LoRA: B split with a
column-parallel layer's output, A split with a row-parallel layer's input).

    column-parallel (q|k|v, gate|up):  W [out, in]  -> rank r keeps rows of each packed slice
    row-parallel    (o, down):         W [out, in]  -> rank r keeps columns in_range; y summed by all-reduce
    vocab-parallel  (embedding, head): W [vocab, h] -> rank r keeps rows [r * part, (r + 1) * part) of
                                                       the vocabulary padded to size * part
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Shard:
    """A contiguous range of one dimension of a checkpoint tensor."""

    dim: int
    """0: rows (output features, vocabulary), 1: columns (input features)."""
    start: int
    """First index kept (full-tensor coordinates)."""
    stop: int
    """One past the last index kept."""

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_part(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, stop) of rank's equal part of ``total`` (which ``size`` divides)."""
    if total % size:
        raise ValueError(f"{total} cannot be split evenly over {size} ranks")
    part = total // size
    return rank * part, (rank + 1) * part


def vocab_part(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, stop, rows): rank's rows of a vocabulary padded to a multiple of ``size``; ``rows`` is
    the padded part every rank holds, stop - start <= rows (the last ranks may hold padding only)."""
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


@dataclass(frozen=True)
class AttentionShard:
    """The attention heads one rank computes."""

    num_heads: int
    """Query heads on this rank (num_attention_heads / size)."""
    num_kv_heads: int
    """KV heads on this rank: num_key_value_heads / size, or 1 when there are fewer KV heads than
    ranks (replicated: the one KV head this rank's query heads read)."""
    kv_head_start: int
    """Index of this rank's first KV head in the checkpoint."""


def attention_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> AttentionShard:
    """Query heads split evenly; KV heads split when num_kv_heads >= size, else replicated so that each
    rank keeps the KV head its query heads share (``ParallelConfig.check_model`` checked divisibility)."""
    heads_per_rank = num_heads // size
    if num_kv_heads >= size:
        kv_per_rank = num_kv_heads // size
        return AttentionShard(heads_per_rank, kv_per_rank, rank * kv_per_rank)
    group = num_heads // num_kv_heads                      # query heads per KV head
    return AttentionShard(heads_per_rank, 1, (rank * heads_per_rank) // group)


@dataclass(frozen=True)
class LinearShard:
    """What one rank holds of a (possibly packed) Linear, in the checkpoint's coordinates."""

    full_input_size: int
    """Input features of the whole projection."""
    full_output_sizes: tuple[int, ...]
    """Each packed slice's output features in the whole projection (q, k, v / gate, up / one)."""
    output_ranges: Optional[tuple[tuple[int, int], ...]] = None
    """Column-parallel: per packed slice, the (start, stop) rows of that slice this rank keeps;
    None: every output row (row-parallel)."""
    input_range: Optional[tuple[int, int]] = None
    """Row-parallel: the (start, stop) input columns this rank keeps; None: all (column-parallel)."""

    def weight_shard(self, slice_idx: int, param: str) -> Optional[Shard]:
        """The range of checkpoint tensor ``param`` ("weight" / "bias") of packed slice ``slice_idx``
        this rank reads; None: the whole tensor (a row-parallel bias)."""
        if self.output_ranges is not None:
            start, stop = self.output_ranges[slice_idx]
            return Shard(0, start, stop)
        if param == "weight" and self.input_range is not None:
            return Shard(1, *self.input_range)
        return None


def column_shard(input_size: int, output_sizes: list[int], ranges: list[tuple[int, int]]) -> LinearShard:
    return LinearShard(input_size, tuple(output_sizes), output_ranges=tuple(ranges))


def row_shard(input_size: int, output_size: int, rank: int, size: int) -> LinearShard:
    return LinearShard(input_size, (output_size,), input_range=even_part(input_size, rank, size))
