"""Tensor-parallel layers (built only when ``tensor_parallel_size`` > 1; a one-process model keeps
the plain ``Linear`` / ``nn.Embedding`` and their fast paths untouched).

- Column-parallel projections (q|k|v, gate|up) are plain ``Linear``s with each packed slice's rows
  cut to the rank's part: no collective, every fused consumer (rotary + KV write, SiLU-and-mul)
  works on the rank's heads / columns as is.
- ``RowParallelLinear`` (o_proj, down_proj): the rank's input columns, one all-reduce of the output.
- ``VocabParallelEmbedding``: the rank's vocabulary rows; ids outside them give zeros, summed by an
  all-reduce. ``parallel_logits``: the rank's rows of the LM head, logits all-gathered.

The sharding math (which rows / columns) is ``engine.distributed.sharding``'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.group import TensorParallelGroup
from engine.distributed.sharding import LinearShard, Shard, column_shard, even_part, row_shard, vocab_part
from engine.kernel_policy import KernelPolicy
from engine.layers.adapter import Feeds
from engine.layers.linear import Linear


class RowParallelLinear(Linear):
    """``y = all_reduce(x_r @ W_r.T) + b``: x_r [num_tokens, input_size / size] is this rank's part of
    the input (the heads / MLP columns it computed), W_r the matching columns.

    NOTE: the all-reduce must happen before anything reads y, so this layer declares ``Feeds.ANY``
    whatever the model passes: no split-K partials (the add + RMSNorm would sum partial products of
    one rank only) and no adapter update deferred into the add + RMSNorm. An adapter's update
    x_r @ A_r.T @ B.T (A split along the input, S-LoRA) is added before the all-reduce and rides on
    it. ``uses_decode_gemv`` is False because the fused SiLU-and-mul + GEMV computes this projection
    outside ``forward`` (it would skip the all-reduce). The bias is kept on rank 0 only
    (``keep_bias_on_first_rank``), so the sum adds it once.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallelGroup,
                 shard: LinearShard, feeds: Feeds = Feeds.ANY) -> None:
        super().__init__(input_size, output_sizes, bias=bias, feeds=Feeds.ANY)
        self.tp = tp
        self.tp_shard = shard
        """The input columns this rank holds (``LinearShard.input_range``)."""
        self.declared_feeds = feeds
        """What the model said reads the output (kept for reference; the all-reduce comes first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size / size] -> [num_tokens, output_size], summed over the ranks."""
        return self.tp.all_reduce(super().forward(x))

    def uses_decode_gemv(self, x: torch.Tensor, policy: KernelPolicy) -> bool:
        return False

    def keep_bias_on_first_rank(self) -> None:
        """Zero the bias on ranks > 0 (after loading): the all-reduce then adds it exactly once."""
        if self.bias is not None and self.tp.rank > 0:
            self.bias.data.zero_()


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, stop) of the embedding table, padded to ``rows`` (every rank the same)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.stop, rows = vocab_part(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)   # [rows, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden]: each id's row from the rank holding it."""
        inside = (input_ids >= self.start) & (input_ids < self.stop)                     # [T]
        local = torch.where(inside, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight).masked_fill_(~inside.unsqueeze(-1), 0.0)  # [T, hidden]
        return self.tp.all_reduce(out)

    def shard(self) -> Shard:
        return Shard(0, self.start, self.stop)


def column_parallel_linear(input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallelGroup,
                           feeds: Feeds = Feeds.ANY) -> Linear:
    """A Linear holding rank's equal part of each packed output slice (the plain Linear at size 1)."""
    layer = Linear(input_size, [s // tp.size for s in output_sizes], bias=bias, feeds=feeds)
    if tp.size > 1:
        layer.tp_shard = column_shard(input_size, output_sizes, [even_part(s, tp.rank, tp.size) for s in output_sizes])
    return layer


def row_parallel_linear(input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup,
                        feeds: Feeds = Feeds.ANY) -> Linear:
    """A ``RowParallelLinear`` over rank's equal part of the ``input_size`` features (the plain Linear,
    with its fast paths, at size 1)."""
    if tp.size == 1:
        return Linear(input_size, [output_size], bias=bias, feeds=feeds)
    return RowParallelLinear(input_size // tp.size, [output_size], bias, tp,
                             row_shard(input_size, output_size, tp.rank, tp.size), feeds=feeds)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup, vocab_size: int
                    ) -> torch.Tensor:
    """hidden: [R, hidden] x this rank's head rows weight [rows, hidden] -> logits [R, vocab_size] on
    every rank (all-gathered, padding dropped)."""
    local = torch.matmul(hidden, weight.t())                     # [R, rows]
    return tp.all_gather(local, dim=-1)[:, :vocab_size]          # [R, vocab_size]


def copy_rows(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy a (vocabulary-)sharded checkpoint tensor into its padded parameter: rows beyond the
    tensor's stay zero. ValueError when the other dimensions differ."""
    if tensor.shape[1:] != param.shape[1:] or tensor.shape[0] > param.shape[0]:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                         f"at most {tuple(param.shape)}")
    param.data[:tensor.shape[0]].copy_(tensor)
    param.data[tensor.shape[0]:].zero_()


def linear_shard_of(module: nn.Module) -> Optional[LinearShard]:
    """The ``LinearShard`` a sharded Linear carries (None: an unsharded one)."""
    return getattr(module, "tp_shard", None)
