"""The device and dtype an engine runs with, resolved from its settings (``auto`` and names)."""

from __future__ import annotations

import torch

from engine.dtypes import TORCH_DTYPES


def resolve_device(name: str) -> torch.device:
    """``--device`` as a device: auto is CUDA where a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'.")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``--dtype`` as a dtype: auto is float32 on CPU, else the checkpoint's half type (or bfloat16)."""
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 prefill is several times slower on CPUs without AMX
    return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
