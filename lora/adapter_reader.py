"""``AdapterReader``: reads PEFT adapters for one base model, wherever the read may run.

It carries what ``load_peft_adapter`` needs to know of the base model (the projections an adapter
may target, the slot rank, the slot dtype) and nothing of the engine, so it pickles to the engine's
client: the client reads an adapter (disk, checks, scale folding) on its own thread and sends the
engine the result, and the engine's step loop never waits for a disk. The engine keeps its own
reader for adapters its host store dropped (``lora.adapter_loader``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora import peft_adapter
from lora.peft_adapter import LoRAAdapter, LoRATargets
from lora.request import LoRARequest


@dataclass(frozen=True)
class AdapterReader:
    """Reads adapters for one base model (``LoRAManager.reader``)."""

    targets: LoRATargets
    """The base model's projections an adapter may update (this rank's shards)."""
    max_lora_rank: int
    """Slot rank: adapters of a larger rank are refused."""
    dtype: torch.dtype
    """dtype of the tensors read (the slot dtype)."""

    def read(self, lora_request: LoRARequest, pin_memory: bool = False) -> LoRAAdapter:
        """Read, check and prepare the adapter ``lora_request`` names (``load_peft_adapter``); with
        ``pin_memory`` its weights are read into page-locked memory.

        Raises:
            LoRAAdapterNotFoundError: its directory or files are missing.
            InvalidLoRAAdapterError: it cannot be served on this base model.
        """
        return peft_adapter.load_peft_adapter(lora_request.lora_name, lora_request.lora_path, self.targets,
                                              self.max_lora_rank, self.dtype, pin_memory=pin_memory)

    def check(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The checks of ``read`` from the adapter's config and its weights file's header only (no weights
        read: a safetensors file's tensors become ``meta`` tensors); the same errors."""
        return peft_adapter.load_peft_adapter(lora_request.lora_name, lora_request.lora_path, self.targets,
                                              self.max_lora_rank, self.dtype, shapes_only=True)
