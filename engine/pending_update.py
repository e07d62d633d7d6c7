"""The adapter update in flight between a producer ``Linear`` and the op that consumes its output.

A Linear whose adapter defers its update leaves one ``PendingUpdate`` in the forward context
(``engine.forward_context.ForwardContext.pending_update``); the consumer op takes it by its input
and completes it (``engine.layers.adapter``). ``lora.layers.LoRAPending`` implements it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PendingUpdate(Protocol):
    """An adapter update a Linear left to the consumer of its base output ``y``."""

    y: torch.Tensor
    """[num_tokens, out] the base output the update belongs to (or a view with the GEMM's stride)."""

    def finish(self) -> torch.Tensor:
        """Add the update into ``y`` in place; returns y."""

    def finish_silu_mul(self) -> torch.Tensor:
        """silu(gate) * up of ``y`` (gate | up) with the update added inside: [num_tokens, out / 2]."""

    def finish_add_rms_norm(self, weight: torch.Tensor, eps: float, residual: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(y + update + residual), y + update + residual), as ``RMSNorm.forward`` with a residual."""

    def finish_rotary_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                               k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """``kernels.kv_write.rotary_write_kv`` on q, k, v (views of ``y``) with the update added first
        (``k_scale`` / ``v_scale``: an FP8 cache's scales)."""
