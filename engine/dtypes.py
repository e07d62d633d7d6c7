"""The one table from dtype names to torch dtypes.

Names come from the engine's settings (``--dtype``, ``--kv-cache-dtype``, ``--lora-dtype``:
``engine.config`` checks which names each accepts) and from a checkpoint's ``config.json``
(``torch_dtype``, which may also say ``float``, ``half`` or ``float64``).
"""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "half": torch.float16,
    "float64": torch.float64,
}
"""dtype name -> torch dtype (the names torch itself uses for them)."""
