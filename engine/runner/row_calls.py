"""``RowCalls``: how the runner calls the model on rows outside the step's tokens (media encoders,
cross-attention K/V), under the engine's forward context and, with LoRA, each row's adapter slot."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np

from engine.forward_context import forward_context
from engine.kernel_policy import KernelPolicy
from kernels.cpu_layer_ops import CpuLayerOps


class RowCalls:
    """Args:
        lora_manager: the engine's ``lora.manager.LoRAManager`` (None: LoRA off).
        policy: the engine's kernel policy (the forward context's).
        cpu_ops: the CPU C layer ops (None: torch's).
    """

    def __init__(self, lora_manager, policy: KernelPolicy, cpu_ops: Optional[CpuLayerOps]) -> None:
        self.lora_manager = lora_manager
        self.policy = policy
        self.cpu_ops = cpu_ops

    @contextlib.contextmanager
    def rows(self, row_lora_slots: Optional[np.ndarray],
             item_rows: Optional[np.ndarray] = None) -> Iterator[None]:
        """Run a model call on rows whose adapter slots are ``row_lora_slots`` ([num_rows] int32; None: the
        call's Linears run no adapter) under ``LoRAManager.rows_batch`` and a forward context without
        attention metadata; ``item_rows`` ([num_items]: each media item's rows there, in order): the call's
        Linears may see other row counts, split among the items in the same proportions (a vision tower's
        patches, then its merged tokens)."""
        lora_rows = (contextlib.nullcontext() if self.lora_manager is None or row_lora_slots is None
                     else self.lora_manager.rows_batch(row_lora_slots, item_rows))
        with lora_rows, forward_context(None, self.policy, cpu_ops=self.cpu_ops):
            yield
